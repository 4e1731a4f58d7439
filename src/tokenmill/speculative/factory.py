"""The proposer an engine config asks for (None: speculative decoding is off)."""

from tokenmill.config import EngineConfig
from tokenmill.loading import LoadedModel
from tokenmill.speculative.ngram import NgramProposer
from tokenmill.speculative.proposer import Proposer


def create_proposer(config: EngineConfig, target: LoadedModel, max_model_len: int) -> Proposer | None:
    spec = config.speculative
    if spec.method is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from tokenmill.speculative.draft_model import DraftModelProposer  # imports the runner

    return DraftModelProposer.load(config, target, max_model_len)
