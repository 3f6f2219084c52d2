"""Tiny random Hugging Face models run whole, each attention module's input
and output captured by forward hooks: the oracle for `from_torch`.

The model, not the test, builds the masks (causal, sliding, chunked) and the
rotary tables (every rope type, with the model's own length rule), so a
test compares `from_torch(module)(x, x, use_causal_mask=True)` with what
the module computed inside the model. Nothing is downloaded.
"""

import dataclasses
import inspect

import numpy as np


@dataclasses.dataclass(frozen=True)
class Captured:
    """One attention module's call inside a model.

    Attributes:
        module: the attention module (`model.model.layers[i].self_attn`).
        hidden_states: `(B, T, E)` float32, its input.
        output: `(B, T, E)` float32, its first output.
        kwargs: the other arguments the decoder layer passed, as given
            (`position_embeddings`, `attention_mask`, `position_ids`, ...).
    """

    module: object
    hidden_states: np.ndarray
    output: np.ndarray
    kwargs: dict


def run_causal_lm(config, token_ids, seed=0, scale=0.25):
    """Builds the `*ForCausalLM` of `config`, runs it, captures attention.

    Args:
        config: a `transformers` config; the model uses eager attention.
        token_ids: `(B, T)` integer array.
        seed: torch seed of the model's weights.
        scale: the attention modules' parameters are redrawn as
            `scale · N(0, 1)` (the model's own initialization is too small
            for the scores, and so the positions, to matter).

    Returns:
        One `Captured` per attention module, in layer order.
    """
    return decode_causal_lm(config, token_ids, None, seed, scale)[0]


def build_causal_lm(config, seed=0, scale=0.25):
    """The `*ForCausalLM` of `config`, eager attention, in eval mode, its
    attention modules' parameters redrawn as `scale · N(0, 1)` (see
    `run_causal_lm`)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).eval()
    redraw(attention_modules(model), scale)
    return model


def redraw(modules, scale):
    """Redraws the modules' parameters as `scale · N(0, 1)` from torch's
    generator: a model's own initialization is too small for the scores,
    and so the positions, to matter.

    A parameter `s` that its module uses as `s · s_scale` (nGPT's stored
    scales: Dory's `sqk`, `s_gate`, with `sqk_scale`, `s_gate_scale`, in
    the thousands) is drawn so that `s · s_scale` is `1 + scale · N(0,
    1)`: drawn as the others, its products would reach the tens of
    thousands and saturate what they scale."""
    import torch

    with torch.no_grad():
        for module in modules:
            for name, parameter in module.named_parameters():
                owner, _, leaf = name.rpartition(".")
                holder = module.get_submodule(owner) if owner else module
                stored = getattr(holder, f"{leaf}_scale", None)
                draw = torch.randn(parameter.shape) * scale
                if isinstance(stored, (int, float)) and stored:
                    draw = (1.0 + draw) / stored
                parameter.copy_(draw)


def attention_modules(model):
    """The model's attention modules, in layer order."""
    return [
        module for name, module in model.named_modules()
        if name.endswith(".self_attn")
    ]


def generate_greedy(model, prompt, new_tokens):
    """Hugging Face's own greedy decoding: `model.generate` with its cache.

    Returns:
        `(tokens, logits)`: `(B, new_tokens)` integers and
        `(B, new_tokens, vocabulary)` float32, the logits that chose them.
    """
    import copy

    import torch

    # No end of sequence: `generate` would stop there, or, told not to,
    # mask its logit.
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    prompt = torch.as_tensor(np.asarray(prompt))
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt),  # no padding
            generation_config=config,
            do_sample=False, max_new_tokens=new_tokens, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[:, prompt.shape[1]:].numpy()
    logits = torch.stack(out.logits, dim=1).float().numpy()
    return tokens, logits


def decode_with(model, attention, prompt, new_tokens):
    """Greedy decoding of `model` with each attention module's forward
    replaced by `attention[i]`, a function `(hidden_states (B, L, E) float32
    array, start) -> (B, L, E) array` that keeps its own cache (`start`:
    the position of the first of the `L` tokens).

    The model runs without its cache (`use_cache=False`) on the prompt, then
    on one token at a time: everything but attention works token by token,
    so the replaced modules see the prompt and then each new token, as
    under `generate`, and the positions come from `start` alone.

    Returns:
        `(tokens, logits)` as `generate_greedy`.
    """
    import torch

    modules = attention_modules(model)
    starts = [0] * len(modules)
    originals = [module.forward for module in modules]

    def replaced(index):
        def forward(hidden_states, *args, **kwargs):
            x = hidden_states.detach().float().numpy()
            y = attention[index](x, starts[index])
            starts[index] += x.shape[1]
            return torch.as_tensor(np.asarray(y, np.float32)), None
        return forward

    for index, module in enumerate(modules):
        module.forward = replaced(index)
    tokens = torch.as_tensor(np.asarray(prompt))
    chosen, logits = [], []
    try:
        with torch.no_grad():
            for _ in range(new_tokens):
                step = model(input_ids=tokens, use_cache=False).logits[:, -1]
                tokens = step.argmax(-1, keepdim=True)
                chosen.append(tokens)
                logits.append(step)
    finally:
        for module, forward in zip(modules, originals):
            module.forward = forward
    return (torch.cat(chosen, 1).numpy(),
            torch.stack(logits, 1).float().numpy())


def decode_causal_lm(config, token_ids, prompt_length, seed=0, scale=0.25):
    """`run_causal_lm`, decoding: the model runs on the first
    `prompt_length` tokens, then on one token at a time, with transformers'
    own key/value cache (`use_cache=True`), as `generate` does.

    Args:
        config, token_ids, seed, scale: as for `run_causal_lm`.
        prompt_length: the first call's length; `None` for one call on
            every token, without a cache.

    Returns:
        One tuple per call of the model, of one `Captured` per attention
        module, in layer order.
    """
    import torch

    model = build_causal_lm(config, seed, scale)
    attention = attention_modules(model)
    captured = []

    def hook(module, args, kwargs, output):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append(Captured(
            module=module,
            hidden_states=hidden.detach().numpy().copy(),
            output=output[0].detach().numpy().copy(),
            kwargs=kwargs,
        ))

    token_ids = torch.as_tensor(np.asarray(token_ids))
    length = token_ids.shape[1]
    calls = [(0, length)] if prompt_length is None else [(0, prompt_length)]
    if prompt_length is not None:
        calls += [(i, i + 1) for i in range(prompt_length, length)]
    handles = [
        module.register_forward_hook(hook, with_kwargs=True)
        for module in attention
    ]
    # transformers 5.24 names the cache `cache`; earlier `past_key_values`.
    name = ("cache" if "cache" in inspect.signature(model.forward).parameters
            else "past_key_values")
    results, cache = [], None
    try:
        with torch.no_grad():
            for start, stop in calls:
                outputs = model(
                    input_ids=token_ids[:, start:stop],
                    use_cache=prompt_length is not None,
                    **{name: cache},
                )
                cache = getattr(outputs, name, None)
                results.append(tuple(captured))
                captured.clear()
    finally:
        for handle in handles:
            handle.remove()
    return results
