"""The query tiles of a prefill launch: which (sequence, tile of consecutive query tokens) each program of
the grid takes, built on the device without a sync and cached across a step's layers."""

from typing import Any, NamedTuple

import torch

from tokenmill.kernels._common import cdiv


class PrefillTiles(NamedTuple):
    """Which (sequence, query tile) each program of the prefill grid takes; surplus programs get
    sequence ``num_seqs`` and exit."""

    tile_seq: torch.Tensor  # int32 [num_programs]
    tile_index: torch.Tensor  # int32 [num_programs]


def prefill_tiles(query_start_loc: torch.Tensor, num_tokens: int, tokens_per_tile: int) -> PrefillTiles:
    """The tile map, built on the device without a sync: the grid is the bound
    ``ceil(T / tokens_per_tile) + B`` on the tile count, whatever the query lengths are."""
    num_seqs = query_start_loc.shape[0] - 1
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    tiles = (query_lens + tokens_per_tile - 1) // tokens_per_tile
    tile_ends = torch.cumsum(tiles, 0)
    programs = torch.arange(cdiv(num_tokens, tokens_per_tile) + num_seqs, device=query_start_loc.device)
    tile_seq = torch.searchsorted(tile_ends, programs, right=True)
    first_tile = (tile_ends - tiles)[tile_seq.clamp(max=max(num_seqs - 1, 0))]
    return PrefillTiles(tile_seq.int(), (programs - first_tile).int())


def cached_tiles(
    query_start_loc: torch.Tensor, num_tokens: int, tokens_per_tile: int, derived: dict[Any, Any] | None
) -> PrefillTiles:
    if derived is None:
        return prefill_tiles(query_start_loc, num_tokens, tokens_per_tile)
    key = (PrefillTiles, num_tokens, tokens_per_tile)
    if key not in derived:
        derived[key] = prefill_tiles(query_start_loc, num_tokens, tokens_per_tile)
    tiles: PrefillTiles = derived[key]
    return tiles
