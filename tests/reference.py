"""An independent float64 NumPy reference of the whole layer.

Loops over nothing clever: project, mask, softmax over the allowed keys
(rows with none get zeros), weighted sum, gate, output projection.
"""

import numpy as np


def layer_weights(layer):
    """The layer's projections as float64 arrays, by name."""
    weights = {}
    dense = {
        "query": layer.query_dense,
        "key": layer.key_dense,
        "value": layer.value_dense,
        "output": layer.output_dense,
    }
    if getattr(layer, "_use_gate", False):
        dense["gate"] = layer._gate_dense
    for name, sublayer in dense.items():
        weights[name] = np.asarray(sublayer.kernel.numpy(), dtype="float64")
        bias = getattr(sublayer, "bias", None)
        weights[name + "_bias"] = (
            None if bias is None else np.asarray(bias.numpy(), dtype="float64")
        )
    return weights


def _project(x, kernel, bias):
    y = np.einsum("bte,enh->btnh", x, kernel)
    return y if bias is None else y + bias


def reference_attention(
    weights,
    query,
    value,
    key=None,
    query_mask=None,
    value_mask=None,
    key_mask=None,
    attention_mask=None,
    use_causal_mask=False,
    sliding_window=None,
    query_offset=0,
):
    """Returns `(output, weights)` for rank-3 inputs, in float64.

    `attention_mask` is given already broadcastable to `(B, N, T, S)` (or
    `(B, T, S)` / `(T, S)`, which are expanded here). Query `t` sits at
    position `query_offset + t`.
    """
    f64 = lambda x: None if x is None else np.asarray(x, dtype="float64")
    query, value = f64(query), f64(value)
    key = value if key is None else f64(key)
    q = _project(query, weights["query"], weights["query_bias"])
    k = _project(key, weights["key"], weights["key_bias"])
    v = _project(value, weights["value"], weights["value_bias"])
    batch, t_len, num_heads, head = q.shape
    s_len, num_kv = k.shape[1], k.shape[2]
    k = np.repeat(k, num_heads // num_kv, axis=2)  # head n reads n // G
    v = np.repeat(v, num_heads // num_kv, axis=2)

    allowed = np.ones((batch, num_heads, t_len, s_len), dtype=bool)
    pos = query_offset + np.arange(t_len)[:, None]
    col = np.arange(s_len)[None, :]
    if use_causal_mask:
        allowed &= col <= pos
    if sliding_window is not None:
        allowed &= np.abs(pos - col) < sliding_window
    if query_mask is not None:
        allowed &= np.asarray(query_mask, bool)[:, None, :, None]
    for m in (value_mask, key_mask):
        if m is not None:
            allowed &= np.asarray(m, bool)[:, None, None, :]
    if attention_mask is not None:
        m = np.asarray(attention_mask, bool)
        if m.ndim == 2:
            m = m[None, None]
        elif m.ndim == 3:
            m = m[:, None]
        allowed &= m

    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(head)
    probs = np.zeros_like(scores)
    for index in np.ndindex(batch, num_heads, t_len):
        row = allowed[index]
        if row.any():
            e = np.exp(scores[index][row] - scores[index][row].max())
            probs[index][row] = e / e.sum()
    context = np.einsum("bnts,bsnv->btnv", probs, v)
    if "gate" in weights:
        gate = _project(query, weights["gate"], weights["gate_bias"])
        context = context / (1.0 + np.exp(-gate))
    out = np.tensordot(context, weights["output"], axes=([2, 3], [0, 1]))
    if weights["output_bias"] is not None:
        out = out + weights["output_bias"]
    return out, probs
