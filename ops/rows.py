# Row tiles of the memory-bound ops' kernels, read from and written to (M, N) rows or, without
# a host-side view (a view costs 1-2 us of host time a tensor), (B, S, N) arrays: with ALONG_S
# a row tile is TILE_M positions of one batch entry (S a multiple of TILE_M), otherwise TILE_M
# batch entries at S = 1 (decode's (B, 1, N)). ALONG_S means nothing for (M, N) rows. Row tile t
# covers rows t * TILE_M onwards either way, so per-row statistics stay (M,) and the grid is
# cdiv(M, TILE_M) row tiles. Columns come in tiles of TILE_N (column tile c).
import cuda.tile as ct

ZERO = ct.PaddingMode.ZERO


def num_row_tiles(a, TILE_M, ALONG_S):
    """How many row tiles a holds."""
    if a.ndim == 3 and ALONG_S:
        return a.shape[0] * (a.shape[1] // TILE_M)
    return ct.cdiv(a.shape[0], TILE_M)


def load_rows(a, t, c, TILE_M, TILE_N, ALONG_S):
    """Tile (t, c) of a's rows: a [TILE_M, TILE_N] float32 tile, zero past the ends."""
    if a.ndim == 2:
        return ct.load(a, (t, c), (TILE_M, TILE_N), padding_mode=ZERO).astype(ct.float32)
    if ALONG_S:
        per_entry = a.shape[1] // TILE_M
        tile = ct.load(a, (t // per_entry, t % per_entry, c), (1, TILE_M, TILE_N),
                       padding_mode=ZERO)
    else:
        tile = ct.load(a, (t, 0, c), (TILE_M, 1, TILE_N), padding_mode=ZERO)
    return ct.reshape(tile, (TILE_M, TILE_N)).astype(ct.float32)


def store_rows(a, t, c, tile, TILE_M, TILE_N, ALONG_S):
    """Tile (t, c) of a's rows = tile ([TILE_M, TILE_N]) in a's dtype; past the ends dropped."""
    tile = tile.astype(a.dtype)
    if a.ndim == 2:
        ct.store(a, (t, c), tile)
    elif ALONG_S:
        per_entry = a.shape[1] // TILE_M
        ct.store(a, (t // per_entry, t % per_entry, c), ct.reshape(tile, (1, TILE_M, TILE_N)))
    else:
        ct.store(a, (t, 0, c), ct.reshape(tile, (TILE_M, 1, TILE_N)))
