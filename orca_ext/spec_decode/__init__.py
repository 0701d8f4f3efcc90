"""Speculative decoding: proposals (n-gram lookup or a draft model) verified as extra rows of
Orca's packed batch. The scheduler asks the ``Speculator`` for proposals, the runner's sampler
samples every row and accepts the longest prefix of proposals its samples equal (exact: each
output token is still a sample of the target's distribution), and the scheduler advances each
request by the tokens accepted."""
from .config import SpeculativeConfig
from .speculator import Proposer, Speculator

__all__ = ["Proposer", "SpeculativeConfig", "Speculator", "make_speculator"]


def make_speculator(config: SpeculativeConfig | None, target=None, block_size: int = 16,
                    num_kv_tokens: int = 0) -> Speculator | None:
    """The Speculator for ``config`` (None: no speculation); a draft model is loaded next to the
    ``target`` LoadedModel with a KV cache of ``num_kv_tokens``."""
    if config is None:
        return None
    if config.method == "ngram":
        from .ngram import NgramProposer

        return Speculator(config, NgramProposer(config.prompt_lookup_min,
                                                config.prompt_lookup_max))
    from .draft_model import build_draft_proposer

    return Speculator(config, build_draft_proposer(config.model, config.quantization, target,
                                                   block_size, num_kv_tokens))
