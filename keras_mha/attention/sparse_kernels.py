"""torch's block-sparse attention: the kept blocks gathered for its fused
kernel (`sparse.sparse_attention`'s native route).

The portable path visits the kept blocks one pair at a time, a dozen
operations each; torch runs them eagerly, one by one. Here the query
blocks, sorted by how many key blocks they keep, go to
`torch.nn.functional.scaled_dot_product_attention` a group at a time, each
query block with its own kept key blocks gathered beside it and padded to
the group's most:

    queries   (g·B, N, b, H)       g query blocks of the group
    keys      (g·B, K, m·b, H)     the m kept key blocks of each, gathered
    mask      (g·B, N|1, b, m·b)   whole blocks kept, partial ones
                                   evaluated, padding slots dropped

So the work follows the kept blocks, as the portable path's does, and
autograd differentiates the gather and the fused kernel. Sorting keeps the
padding small: a group's query blocks keep nearly as many blocks each.
The mask is evaluated inside the partial blocks only; a group of whole
blocks with no padding calls the kernel without a mask.
"""

import numpy as np

# Query blocks a fused call takes: fewer calls against the padding of a
# group whose blocks keep unequal counts, and the keys gathered for it.
GROUP = 4


def block_sparse(query, key, value, mask, some, every, block, scale):
    """Attention over the blocks of `some` (`sparse.sparse_attention`).

    Args:
        query: `(B, T, N, H)`, float32 or float64.
        key: `(B, S, K, H)`.
        value: `(B, S, K, V)`.
        mask: the call's `rules.Mask`.
        some, every: the mask's `(n_q, n_k)` NumPy block map.
        block: `b`, positions per block.
        scale: multiplies the logits.

    Returns:
        `(B, T, N, V)`; a row with no allowed key gets 0.
    """
    import torch

    batch, t_len, num_heads, _ = query.shape
    s_len, value_head = key.shape[1], value.shape[3]
    n_q, n_k = some.shape
    every = every.copy()
    if s_len % block:  # the last key block's padding is masked
        every[:, -1] = False
    # Blocks first, so a group gathers whole blocks along one axis (an
    # `index_select`, whose gradient adds rows back in place).
    q, k, v = (_blocks(x, n, block) for x, n in (
        (query, n_q), (key, n_k), (value, n_k)))  # (n, B, N|K, b, X)
    counts = some.sum(axis=1)
    order = np.argsort(counts, kind="stable")
    outs = []
    for start in range(0, n_q, GROUP):
        rows = order[start:start + GROUP]
        outs.append(_group(q, k, v, mask, some, every, rows, block, scale,
                           s_len))
    out = torch.cat(outs, dim=0)  # (n_q, B, N, b, V), sorted
    out = out.index_select(0, _index(np.argsort(order), out))
    out = out.permute(1, 0, 3, 2, 4).reshape(
        batch, n_q * block, num_heads, value_head)
    return out[:, :t_len]


def _blocks(x, count, block):
    """`(B, L, H, X)` -> `(count, B, H, b, X)`, zeros after `L`."""
    import torch

    pad = count * block - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_zeros((x.shape[0], pad, *x.shape[2:]))],
                      dim=1)
    x = x.reshape(x.shape[0], count, block, x.shape[2], x.shape[3])
    return x.permute(1, 0, 3, 2, 4)


def _index(values, like):
    import torch

    return torch.as_tensor(np.asarray(values, np.int64), device=like.device)


def _group(q, k, v, mask, some, every, rows, block, scale, key_length):
    """The outputs `(g, B, N, b, V)` of query blocks `rows`."""
    import torch

    g = len(rows)
    _, batch, num_heads, _, head = q.shape
    num_kv = k.shape[2]
    width = max(int(some[rows].sum(axis=1).max()), 1)  # m
    cols = np.zeros((g, width), np.int64)
    valid = np.zeros((g, width), bool)
    whole = np.zeros((g, width), bool)
    for r, i in enumerate(rows):
        kept = np.flatnonzero(some[i])
        cols[r, :len(kept)] = kept
        valid[r, :len(kept)] = True
        whole[r, :len(kept)] = every[i, kept]
    q_g = q.index_select(0, _index(rows, q)).reshape(
        g * batch, num_heads, block, head)
    k_g, v_g = (
        x.index_select(0, _index(cols.reshape(-1), x))  # (g·m, B, K, b, X)
        .reshape(g, width, batch, num_kv, block, x.shape[-1])
        .permute(0, 2, 3, 1, 4, 5)
        .reshape(g * batch, num_kv, width * block, x.shape[-1])
        for x in (k, v))
    keep = _keep(mask, rows, cols, valid, whole, block, key_length, batch,
                 num_heads, q.device)

    def attend(attn_mask):
        return torch.nn.functional.scaled_dot_product_attention(
            q_g, k_g, v_g, attn_mask=attn_mask, scale=scale,
            enable_gqa=num_heads != num_kv)

    if keep is None:
        out = attend(None)
    else:
        has_key = keep.any(dim=-1, keepdim=True)  # (g·B, N|1, b, 1)
        if bool(has_key.all()):
            out = attend(keep)
        else:  # the kernel needs a key in every row; those rows get 0
            out = torch.where(has_key, attend(keep | ~has_key),
                              q_g.new_zeros(()))
    return out.reshape(g, batch, num_heads, block, v.shape[-1])


def _keep(mask, rows, cols, valid, whole, block, key_length, batch,
          num_heads, device):
    """The boolean `(g·B, N|1, b, m·b)` kept entries, or `None` when the
    group keeps every slot whole."""
    import torch

    partial = valid & ~whole
    if valid.all() and not partial.any():
        return None
    g, width = valid.shape
    keep = torch.as_tensor(valid, device=device)[:, None, None, :, None, None]
    if partial.any():
        r_idx, c_idx = np.nonzero(partial)
        offsets = np.arange(block)
        query_at = (rows[r_idx][:, None] * block + offsets).reshape(
            1, 1, -1, 1)
        key_at = np.repeat(cols[r_idx, c_idx][:, None] * block + offsets,
                           block, axis=0)[None, None]  # (1, 1, P·b, b)
        index = [torch.as_tensor(x, dtype=torch.int32, device=device) for x
                 in (np.arange(batch).reshape(-1, 1, 1, 1),
                     np.arange(num_heads).reshape(1, -1, 1, 1),
                     query_at, key_at)]
        found = torch.logical_and(mask.evaluate(*index),
                                  index[3] < key_length)
        found = found.reshape(*found.shape[:2], len(r_idx), block, block)
        size_b, size_n = found.shape[:2]
        keep = keep.expand(g, size_b, size_n, width, block, block).clone()
        at_rows, at_cols = (torch.as_tensor(x, device=device)
                            for x in (r_idx, c_idx))
        keep[at_rows, :, :, at_cols] = found.permute(2, 0, 1, 3, 4)
    size_n = keep.shape[2]
    keep = keep.expand(g, batch, size_n, width, block, block)
    keep = keep.permute(0, 1, 2, 4, 3, 5)  # (g, B, N|1, b, m, b)
    return keep.reshape(g * batch, size_n, block, width * block)
