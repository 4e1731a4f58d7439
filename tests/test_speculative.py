"""Speculative decoding in the engine: greedy outputs identical to the reference loop (and to the engine
without speculation) for both proposers, on tiny models of every architecture, under batching,
preemption, chunked prefill and prefix hits; the config and its errors; the metrics."""

import random
from pathlib import Path
from typing import Any

import pytest

from engine_helpers import engine_for, run_to_completion
from spec_workloads import repetitive_workload, run_workload
from tiny_models import save_tiny_model, tiny_configs
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.config_flags import parse_speculative_config
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.loading import LoadedModel, load_model
from tokenmill.reference import greedy_generate

NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}
ARCHITECTURES = sorted(tiny_configs())


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    loaded = {}
    for name in ARCHITECTURES:
        folder = tmp_path_factory.mktemp(f"spec-{name}")
        save_tiny_model(name, folder)
        loaded[name] = load_model(folder, dtype="float32")
    return loaded


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, LoadedModel]) -> LoadedModel:
    return tiny_models["llama3"]


def speculative_engine(target: LoadedModel, draft: LoadedModel | None = None, **options: Any) -> LLMEngine:
    """An engine over ``target``: n-gram speculation, or with ``draft`` the draft-model proposer."""
    options.setdefault("device", "cpu")
    options.setdefault("cpu_kv_cache_gib", 0.25)
    if draft is None:
        options = {**NGRAM, **options}
    else:
        options["speculative_config"] = {
            "method": "draft_model",
            "model": "given",
            "num_speculative_tokens": 3,
        }
    return LLMEngine(EngineConfig().with_options(**options), loaded=target, draft=draft)


def assert_matches_reference(
    target: LoadedModel, workload: dict[str, tuple[list[int], int]], outputs: dict[str, list[int]]
) -> None:
    for rid, (prompt, max_tokens) in workload.items():
        assert outputs[rid] == greedy_generate(target.model, prompt, max_tokens).token_ids, rid


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("proposer", ["ngram", "self-draft"])
def test_greedy_speculation_matches_the_reference_on_every_architecture(
    tiny_models, architecture, proposer
) -> None:  # type: ignore[no-untyped-def]
    target = tiny_models[architecture]
    workload = repetitive_workload(random.Random(3), 6)
    engine = speculative_engine(
        target, target if proposer == "self-draft" else None, max_num_seqs=4, debug_checks=True
    )
    outputs = run_workload(engine, workload)
    assert_matches_reference(target, workload, outputs)
    spec = engine.scheduler_stats().spec_decode
    assert spec.num_proposed > 0 and spec.num_accepted > 0
    if proposer == "self-draft":  # the draft is the model: every greedy guess is the model's token
        assert spec.num_accepted == spec.num_proposed
    assert engine.kv_cache.manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("chunked", "prefix_caching", "tight_pool"),
    [(False, False, False), (True, True, False), (True, False, True), (False, True, True)],
)
@pytest.mark.parametrize("proposer", ["ngram", "other-draft"])
def test_greedy_speculation_survives_chunking_prefix_hits_and_preemption(
    tiny_models, chunked, prefix_caching, tight_pool, proposer
) -> None:  # type: ignore[no-untyped-def]
    target = tiny_models["llama3"]
    draft = tiny_models["qwen2"] if proposer == "other-draft" else None  # same vocabulary, other weights
    rng = random.Random(11)
    shared = [rng.randrange(3, 384) for _ in range(12)]
    workload = {
        rid: (shared + prompt, max_tokens)
        for rid, (prompt, max_tokens) in repetitive_workload(rng, 12).items()
    }
    engine = speculative_engine(
        target,
        draft,
        kv_cache="paged",
        block_size=4,
        num_kv_blocks=14 if tight_pool else 200,
        max_num_seqs=6,
        max_num_batched_tokens=16 if chunked else 64,
        max_model_len=64,
        chunked_prefill=chunked,
        prefill_chunk_size=5 if chunked else None,
        prefix_caching=prefix_caching,
        debug_checks=True,
    )
    outputs = run_workload(engine, workload, seed=5)
    assert_matches_reference(target, workload, outputs)
    stats = engine.scheduler_stats()
    assert stats.spec_decode.num_proposed > 0
    assert stats.spec_decode.num_accepted < stats.spec_decode.num_proposed or proposer == "ngram"
    assert (stats.num_preemptions > 0) == tight_pool
    assert (stats.prefix_cache_hits > 0) == prefix_caching
    assert engine.kv_cache.manager.num_used_blocks == 0


def test_seeded_sampling_gives_the_same_tokens_with_ngram_guesses_as_without(tiny) -> None:  # type: ignore[no-untyped-def]
    """n-gram guesses are decided by each position's own plain-step draw (seeded noise keyed by the seed
    and the position), so a seeded request's tokens do not depend on whether, or how often, its steps
    guessed: alone (guessing), in a batch (past the cutoff: plain steps) and without speculation."""
    rng = random.Random(3)
    pattern = [rng.randrange(3, 384) for _ in range(4)]
    prompts = [[rng.randrange(3, 384) for _ in range(3)] + pattern * 4 for _ in range(3)]
    seeded = [SamplingParams(temperature=0.1, max_tokens=24, seed=7 + i, ignore_eos=True) for i in range(3)]
    fillers = [[rng.randrange(3, 384) for _ in range(6)] for _ in range(5)]
    filler_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(engine: LLMEngine, with_fillers: bool) -> list[list[int]]:
        llm = LLM(engine=engine)
        batch = prompts + (fillers if with_fillers else [])
        params = seeded + ([filler_params] * len(fillers) if with_fillers else [])
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        return [output.outputs[0].token_ids for output in outputs[: len(prompts)]]

    plain = tokens(speculative_engine(tiny, speculative_config=None), False)
    guessing = speculative_engine(tiny, speculative_disable_by_batch_size=4)
    alone = [tokens(guessing, False)[0]]  # one at a time: every step may guess
    alone += [tokens(guessing, False)[i] for i in (1, 2)]
    stats = guessing.scheduler_stats().spec_decode
    assert 0 < stats.num_accepted < stats.num_proposed  # guesses kept and guesses rejected
    assert alone == plain
    assert tokens(guessing, True) == plain  # 8 sequences: past the cutoff, plain steps


def test_a_draft_whose_guesses_did_not_all_fit_catches_up_from_the_last_token(tiny) -> None:  # type: ignore[no-untyped-def]
    """A tight pool attaches fewer guesses than the draft made; when all are accepted, the model's next
    token is the draft's next guess, whose KV the draft has: it still recomputes the last token, whose
    logits give the next round's first guess."""
    workload = repetitive_workload(random.Random(3), 6)
    engine = speculative_engine(
        tiny, tiny, block_size=4, num_kv_blocks=14, max_model_len=64, max_num_seqs=4, debug_checks=True
    )
    outputs = run_workload(engine, workload)
    assert_matches_reference(tiny, workload, outputs)
    stats = engine.scheduler_stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode.num_accepted == stats.spec_decode.num_proposed > 0


def test_priority_preemption_with_speculation_keeps_greedy_outputs(tiny) -> None:  # type: ignore[no-untyped-def]
    workload = repetitive_workload(random.Random(2), 8)
    engine = speculative_engine(
        tiny,
        kv_cache="paged",
        block_size=4,
        num_kv_blocks=12,
        max_num_seqs=3,
        scheduling_policy="priority",
        debug_checks=True,
    )
    outputs: dict[str, list[int]] = {rid: [] for rid in workload}
    for index, (rid, (prompt, max_tokens)) in enumerate(workload.items()):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(rid, prompt, params, priority=-index)  # later arrivals preempt earlier ones
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    assert_matches_reference(tiny, workload, outputs)
    assert engine.scheduler_stats().num_preemptions > 0


def test_a_sequence_preempted_after_the_guessing_drops_its_guesses(tiny) -> None:  # type: ignore[no-untyped-def]
    """Guesses are made before the step is scheduled; a sequence that scheduling then preempts (a sequence
    before it needed its blocks) must drop them. Kept, they were verified once it was readmitted into a
    batch of ``disable_by_batch_size`` sequences, where no step may guess. (Found by a random search.)"""
    cutoff = 3
    engine = speculative_engine(
        tiny, block_size=4, num_kv_blocks=16, max_num_seqs=4, speculative_disable_by_batch_size=cutoff
    )
    patterns = [
        [158, 190, 151],
        [364, 363, 279],
        [145, 59, 16],
        [199, 217, 132],
        [165, 330, 353],
        [73, 285, 34],
    ]
    max_tokens = [13, 29, 15, 24, 20, 12]
    workload = {
        f"r{i}": (pattern * 3, n) for i, (pattern, n) in enumerate(zip(patterns, max_tokens, strict=True))
    }
    arrivals, outputs = list(workload), {rid: [] for rid in workload}
    guessed_at: list[int] = []  # running sequences at each step that verified guesses
    step = 0
    while arrivals or engine.has_unfinished_requests():
        if arrivals and step % 3 == 0:
            rid = arrivals.pop(0)
            prompt, max_tokens = workload[rid]
            engine.add_request(
                rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            )
        running, before = len(engine.scheduler.running), engine.scheduler.stats.spec_decode.num_steps
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        if engine.scheduler.stats.spec_decode.num_steps > before:
            guessed_at.append(running)
        step += 1
    assert_matches_reference(tiny, workload, outputs)
    assert engine.scheduler_stats().num_preemptions > 0
    assert guessed_at and max(guessed_at) < cutoff


def test_max_tokens_eos_and_stop_tokens_end_a_multi_token_step_exactly(tiny) -> None:  # type: ignore[no-untyped-def]
    """A token after the one that ends the sequence is dropped, whatever the verification accepted."""
    prompt = [5, 6, 7, 8] * 4
    reference = greedy_generate(tiny.model, prompt, 30).token_ids
    stop_token = reference[9]
    first_stop = reference.index(stop_token)
    for params, expected, reason in [
        (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), reference[:7], "length"),
        (
            SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]),
            reference[: first_stop + 1],
            "stop",
        ),
    ]:
        engine = speculative_engine(tiny)
        engine.add_request("r", prompt, params)
        tokens, finish = [], None
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.new_token_ids
                finish = delta.finish_reason or finish
        assert (tokens, finish) == (expected, reason)
        assert engine.scheduler_stats().spec_decode.num_proposed > 0


def test_opted_out_requests_and_structured_ones_do_not_speculate(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = speculative_engine(tiny)
    prompt = [5, 6, 7, 8] * 4
    engine.add_request(
        "r", prompt, SamplingParams(temperature=0, max_tokens=20, speculative=False, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler_stats().spec_decode.num_steps == 0
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")  # type: ignore[arg-type]


def test_speculative_config_as_vllm_takes_it_and_its_errors() -> None:
    config = EngineConfig().with_options(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 5)
    assert EngineConfig().speculative.method is None  # off by default
    drafted = EngineConfig().with_options(speculative_config={"model": "smollm2"})
    assert drafted.speculative.method == "draft_model"
    with pytest.raises(ValueError, match=r"unknown key.*'k'"):
        EngineConfig().with_options(speculative_config={"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig().with_options(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig().with_options(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        EngineConfig().with_options(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    assert parse_speculative_config('{"method": "ngram"}') == {"method": "ngram"}
    for bad in ("{method: ngram}", "[1]", '{"method": "eagle"}'):
        with pytest.raises(Exception, match=r"JSON|object|speculative_method"):
            parse_speculative_config(bad)


def test_a_draft_with_another_vocabulary_is_refused(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, LlamaConfig

    AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=512,
        )
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_engine(tiny, load_model(tmp_path, dtype="float32"))


def test_a_request_id_like_another_requests_sequence_id_gets_its_own_draft(tiny) -> None:  # type: ignore[no-untyped-def]
    """The draft keeps one shadow sequence per sequence: request "x[0]" beside request "x" with n=2 (whose
    first sequence is "x[0]" too) gets its own, and every greedy guess of the self-draft is accepted."""
    engine = speculative_engine(tiny, tiny, debug_checks=True)
    pattern = [50, 60, 70]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    workload = {
        "x": ([5, 6, 7, *pattern * 3], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)),
        "x[0]": ([200, 201, *pattern * 4], greedy),
    }
    outputs = run_to_completion(engine, workload)
    for rid, (prompt, params) in workload.items():
        expected = greedy_generate(tiny.model, prompt, 12).token_ids
        assert [o.token_ids for o in outputs[rid].outputs] == [expected] * params.n, rid
    spec = engine.scheduler_stats().spec_decode
    assert spec.num_accepted == spec.num_proposed > 0


def test_request_metrics_count_drafts_and_accepted_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    from tokenmill.llm import LLM

    llm = LLM(engine=speculative_engine(tiny))
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7, 8] * 4}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )[0]
    metrics = out.metrics
    assert metrics["spec_decode_num_draft_tokens"] > 0
    assert metrics["spec_decode_num_accepted_tokens"] <= metrics["spec_decode_num_draft_tokens"]
    steps, emitted = metrics["spec_decode_num_steps"], metrics["spec_decode_num_emitted_tokens"]
    assert steps + metrics["spec_decode_num_accepted_tokens"] >= emitted >= steps
    assert emitted <= len(out.outputs[0].token_ids)
    assert metrics["spec_decode_mean_accepted_length"] == pytest.approx(emitted / steps)
    assert engine_for(tiny).scheduler_stats().spec_decode.num_steps == 0


def test_a_large_batch_runs_plain_decode_steps(tiny) -> None:  # type: ignore[no-untyped-def]
    """At ``disable_by_batch_size`` running sequences no step speculates; below it, steps do again."""
    workload = repetitive_workload(random.Random(4), 6)
    engine = speculative_engine(tiny, speculative_disable_by_batch_size=4, max_num_seqs=6)
    assert engine.config.speculative.disable_by_batch_size == 4
    proposed_at: list[int] = []
    for rid, (prompt, max_tokens) in workload.items():
        engine.add_request(
            rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens + 20, ignore_eos=True)
        )
    outputs: dict[str, list[int]] = {rid: [] for rid in workload}
    while engine.has_unfinished_requests():
        running, before = len(engine.scheduler.running), engine.scheduler.stats.spec_decode.num_steps
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        if engine.scheduler.stats.spec_decode.num_steps > before:
            proposed_at.append(running)
    assert proposed_at and max(proposed_at) < 4
    assert_matches_reference(tiny, {rid: (p, n + 20) for rid, (p, n) in workload.items()}, outputs)
    assert EngineConfig().with_options(speculative_method="ngram").speculative.disable_by_batch_size is None


@pytest.mark.parametrize("proposer", ["self-draft", "other-draft"])
def test_a_draft_runs_its_steps_through_graph_runners(tiny_models, proposer) -> None:  # type: ignore[no-untyped-def]
    """The draft's one-token steps go through decode graphs and a lone sequence's catch-up through the
    one-sequence prefill graphs (run eagerly over their static buffers here, as before capture on a
    GPU); the greedy tokens stay the reference loop's, and a self-draft still accepts every guess."""
    from tokenmill.runner.cuda_graphs import DecodeGraphRunner
    from tokenmill.runner.prefill_graphs import PrefillGraphRunner
    from tokenmill.speculative.draft_model import DraftModelProposer

    target = tiny_models["llama3"]
    draft = target if proposer == "self-draft" else tiny_models["qwen2"]
    engine = speculative_engine(
        target, draft, block_size=4, num_kv_blocks=200, max_model_len=96, max_num_seqs=3, debug_checks=True
    )
    assert isinstance(engine.proposer, DraftModelProposer)
    runner = engine.proposer.runner
    assert runner.kv.layers is not None
    args = (runner.model, runner.backend, runner.kv.layers, runner.kv.manager)
    runner.decode_graphs = DecodeGraphRunner(*args, (1, 2, 4), 96, False, runner.sampler.argmax)
    runner.prefill_graphs = PrefillGraphRunner(*args, (8, 16, 64), 96)
    used = {"decode": 0, "prefill": 0}
    for name, graphs in (("decode", runner.decode_graphs), ("prefill", runner.prefill_graphs)):
        run = graphs.run

        def counted(*call: Any, _run: Any = run, _name: str = name) -> Any:
            used[_name] += 1
            return _run(*call)

        graphs.run = counted  # type: ignore[method-assign]
    workload = repetitive_workload(random.Random(7), 5)
    outputs = run_workload(engine, workload, seed=2)
    assert_matches_reference(target, workload, outputs)
    spec = engine.scheduler_stats().spec_decode
    assert used["decode"] > 0 and used["prefill"] > 0, used
    assert spec.num_proposed > 0
    assert (spec.num_accepted == spec.num_proposed) == (proposer == "self-draft")
