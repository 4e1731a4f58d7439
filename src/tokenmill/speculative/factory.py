"""The proposer an engine config asks for (None: speculative decoding is off)."""

from tokenmill.config import EngineConfig
from tokenmill.kernels.options import KernelOptions
from tokenmill.loading import LoadedModel
from tokenmill.speculative.ngram import NgramProposer
from tokenmill.speculative.proposer import Proposer


def create_proposer(
    config: EngineConfig,
    target: LoadedModel,
    max_model_len: int,
    options: KernelOptions,
    draft: LoadedModel | None = None,
) -> Proposer | None:
    """``options``: the target's kernel paths, which the draft takes too; ``draft``: a loaded draft model
    to use instead of loading ``speculative_model`` (tests share one)."""
    spec = config.speculative
    if spec.method is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from tokenmill.speculative.draft_model import DraftModelProposer  # imports the runner

    return DraftModelProposer.load(config, target, max_model_len, options, draft)
