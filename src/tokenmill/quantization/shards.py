"""Where a checkpoint tensor's rows (and columns) go in a layer's parameters, whatever their units.

A linear layer knows which rows of a checkpoint weight this rank holds and where they go in its (possibly
fused) weight: a :class:`RowShard`, in rows of the weight. Its parameters store those rows in different
units: the weight and a bias one per row, a per-channel scale one per row without columns, a block scale
one per 128 x 128 block. :class:`ParamLayout` translates a shard into a parameter's units and copies it, so
one sharding rule per layer serves every format.
"""

from dataclasses import dataclass

import torch

ColumnRange = tuple[int, int, int]  # (checkpoint columns, first column this rank holds, columns it holds)


@dataclass(frozen=True)
class RowShard:
    """Rows ``[source, source + size)`` of a checkpoint tensor of ``full_rows`` rows go to rows
    ``[target, target + size)`` of the layer's weight; ``columns``: only that column range (row-parallel
    layers), None: every column."""

    full_rows: int
    source: int
    size: int
    target: int
    columns: ColumnRange | None = None

    @staticmethod
    def whole(rows: int) -> "RowShard":
        return RowShard(rows, 0, rows, 0)


def _units(start: int, size: int, full: int, block: int, what: str) -> tuple[int, int]:
    """``[start, start + size)`` of ``full`` elements in ``block``-element units: it must start on a block
    and end on one (or at the end of the tensor, where the last block may be partial)."""
    if block == 1:
        return start, size
    if start % block or (size % block and start + size != full):
        raise ValueError(
            f"{what} [{start}, {start + size}) do not fall on {block}-element blocks: block-scaled "
            f"weights split only on block boundaries"
        )
    return start // block, -(-size // block)


@dataclass(frozen=True)
class ParamLayout:
    """How a parameter stores the weight's ``[rows, cols]``: ``row_block`` rows per stored row, and
    ``col_block`` columns per stored column (None: the parameter has no column dimension)."""

    row_block: int = 1
    col_block: int | None = 1

    def expected_shape(self, shard: RowShard, param: torch.Tensor) -> tuple[int, ...]:
        rows = -(-shard.full_rows // self.row_block)
        if self.col_block is None:
            return (rows,)
        if shard.columns is None:
            return (rows, param.shape[1])
        return (rows, -(-shard.columns[0] // self.col_block))

    def select(self, param: torch.Tensor, loaded: torch.Tensor, shard: RowShard) -> torch.Tensor:
        """The part of ``loaded`` this shard names, in the parameter's units (shape checked)."""
        if self.col_block is None and loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded.reshape(-1)  # per-channel scales published as [out, 1]
        expected = self.expected_shape(shard, param)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {expected}")
        start, size = _units(shard.source, shard.size, shard.full_rows, self.row_block, "rows")
        piece = loaded.narrow(0, start, size)
        if shard.columns is not None and self.col_block is not None:
            full, first, count = shard.columns
            col_start, cols = _units(first, count, full, self.col_block, "columns")
            piece = piece.narrow(1, col_start, cols)
        return piece

    def target_rows(self, param: torch.Tensor, shard: RowShard, rows: int) -> torch.Tensor:
        """The ``rows`` stored rows of ``param`` this shard fills (a view to copy into); a partial block
        may only be the parameter's last."""
        start = shard.target // self.row_block
        if shard.target % self.row_block or (shard.size % self.row_block and start + rows != param.shape[0]):
            raise ValueError(
                f"goes to rows [{shard.target}, {shard.target + shard.size}) of a fused weight, which do not "
                f"fall on {self.row_block}-row blocks: block-scaled weights fuse only on block boundaries"
            )
        return param.data.narrow(0, start, rows)

    def store(self, param: torch.Tensor, loaded: torch.Tensor, shard: RowShard) -> None:
        piece = self.select(param, loaded, shard)
        self.target_rows(param, shard, piece.shape[0]).copy_(piece)


DENSE = ParamLayout()  # a weight: one stored element per element
PER_ROW = ParamLayout(col_block=None)  # a bias or per-channel scale: one value per row


def layout_of(param: torch.Tensor) -> ParamLayout:
    """The layout a quantization method attached (``param.shard_layout``), else dense or per row."""
    layout = getattr(param, "shard_layout", None)
    if isinstance(layout, ParamLayout):
        return layout
    return PER_ROW if param.dim() == 1 else DENSE
