"""Token generation with a KV cache: a prefill shard_map, then one decode-step shard_map per token.

    mesh = decode_mesh(batch=1, cfg=cfg)                   # a mesh the batch and model fit
    sampling = Sampling(max_new_tokens=32, temperature=0.8, top_k=40, key=jax.random.key(0))
    out = generate(weights, prompt, cfg, mesh, sampling)   # i32[B, P + 32]: prompt, then new

Token ids in, token ids out: text prompts and their decoding live in :mod:`seqshard.sample`,
so the model never imports the data pipeline or a tokenizer.

Dimensions are the training forward's (see ``transformer.py``): B, M, F, V, Q, K, D; L is the
prompt length in prefill and 1 (the fed token) in a decode step; S is the cache length, the
longest sequence (prompt + generated) the cache holds; C is the top-k candidates that the t
shards pool. Mesh axes: d (batch, and FSDP weight rows) and t (heads, d_ff, vocab, M).

Everything runs in the training layout, one shard_map per phase, in one jit per
:class:`DecodeSpec` (the static options) and prompt shape:

    _prefill      'B/dp L@zigzag/c' prompt -> the cache and the last position's logits 'B/dp V/t'
    _decode_step  'B/dp' token, cache -> cache with the token's entry written at its index, logits
    sampling      inside both shard_maps, on the vocab-sharded logits; the steps run in a
                  ``lax.while_loop`` (:func:`_run`), which ends once every row has stopped
                  (at ``stop_token``, or where a :class:`StopMatcher` accepts)

What a layer caches is its attention kind's (``model.attention``; :data:`_CACHES`, one row each):

    gqa  'all_layers 2 B/dp S K/t D'  k at [:, 0], v at [:, 1]; a decode step attends over them
    mla  'all_layers B/dp S A'        the normed kv latent and the rotated rope key, replicated
                                      over t; a decode step attends in the absorbed form
                                      (:mod:`seqshard.model.mla_decode`)

Prefill runs each layer's attention block as the training forward does, keeping the cache's
entries of the prompt; :func:`cache_bytes_per_token` gives a layer's cache bytes per position.

Per layer and decode step the communication is the training forward's with L = 1: the
all-gathers of every weight over d (FSDP; none when d = 1, which is why :func:`decode_mesh`
fills t first), the residual's all-gather over t and two psum_scatters over t. The cache never
moves: each t shard writes its own block (gqa: its heads; mla: the whole, from the latents
every t shard computes).

Sampling never gathers the vocabulary. Softmax sampling at temperature T is the Gumbel-max
trick: ``argmax(logits / T + g)`` with g standard Gumbel noise, drawn for the global
'B V' array (partitionable threefry, so every device makes only its block and the same key
gives the same tokens on every mesh). Each t shard takes its block's max and argmax; two
``pmax`` over t of 'B/dp' scalars pick the winner (the lowest id on ties, as ``jnp.argmax``).
top-k pools each shard's k largest logits ('B/dp C/t', all-gathered over t: B*t*k values),
takes the k-th largest of the pool as the threshold, and masks the logits below it (ties at
the threshold all stay in). Temperature 0 is greedy: the same argmax without noise.

Prompts are single documents at positions 0.. and may differ in length: rows are
*left-padded* to a common length P, with ``prompt_lengths`` giving each row's real length.
Padding never enters attention (masked keys) and each row's RoPE positions start at 0 at its
first real token, so a padded row generates what it would alone (up to f32 rounding).
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from seqshard.mesh import AXES, axis_size, mesh_of_sizes
from seqshard.model import attention_block, mla_decode
from seqshard.model.attention import attention
from seqshard.model.attention import rope as rope_cos_sin
from seqshard.model.block import Activations
from seqshard.model.config import ModelConfig
from seqshard.model.context import gathered_kv
from seqshard.model.layers import stacks
from seqshard.model.transformer import after_attention, embed, final_norm, unembed
from seqshard.model.weights import Weights, check_mesh, weights_type
from seqshard.shardlib import shardops
from seqshard.shardlib.shapecheck import shape_scope
from seqshard.shardlib.shardtypes import ArrayType, bf16, f32, i32, shardings, typed_shard_map

__all__ = [
    "DecodeSpec",
    "Sampling",
    "StopMatcher",
    "cache_bytes_per_token",
    "decode_mesh",
    "generate",
]

_CACHE_DTYPES = {"float32": f32, "bfloat16": bf16}


# ---------------------------------------------------------------------------------------------
# What each attention kind caches


def _gqa_entry(cfg: ModelConfig, w, a: Activations, rope) -> jax.Array:
    """The attention block's q, k, v of the positions ``a['x']`` (left in ``a``), and what the
    cache keeps of them: k and v '2 B/dp L@zigzag/c K/t D'."""
    _, k, v = attention_block.attention_inputs(cfg, w, a, rope)
    return jnp.stack([k, v])


def _gqa_decode(cfg: ModelConfig, w, a: Activations, cache: jax.Array, mask: jax.Array):
    """The block's output h for the fed positions whose q ``a`` holds, attending over one
    layer's cache '2 B/dp S K/t D'."""
    cache_k, cache_v = cache
    # One query against the cache is a matrix-vector product: plain einsum attention.
    a("attn", lambda: attention(a["q"], cache_k, cache_v, mask, "einsum", causal_only=False))
    return attention_block.attention_output(cfg, w, a)


@dataclasses.dataclass(frozen=True)
class _Cache:
    """How a layer of one attention kind caches its keys and values.

    ``spec``: the whole cache's type, S its positions. ``entry(cfg, w, a, rope)``: the block's
    inputs of the positions ``a['x']`` (q, k, v left in ``a``) and their cache entries, the
    layout of one layer's cache with L for S. ``decode(cfg, w, a, cache, mask)``: the block's
    output h for the fed token, ``a`` as ``entry`` left it, over one layer's cache.
    ``bytes_per_token(cfg)``: the bytes one position of one row adds to one layer's cache."""

    spec: str
    entry: Callable
    decode: Callable
    bytes_per_token: Callable[[ModelConfig], int]

    @property
    def seq_axis(self) -> int:
        """S's place in ``spec``."""
        return self.spec.split().index("S")


_CACHES = {
    "gqa": _Cache(
        "all_layers 2 B/dp S K/t D",
        _gqa_entry,
        _gqa_decode,
        lambda m: 2 * m.n_kv * m.d_head * m.compute_bytes,
    ),
    "mla": _Cache(
        mla_decode.CACHE_SPEC,
        mla_decode.cache_entry,
        mla_decode.decode_attention,
        mla_decode.cache_bytes_per_token,
    ),
}
"""``model.attention`` -> what its layers cache."""


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes one position of one row adds to one layer's cache, in compute dtype: 2 n_kv d_head
    numbers for grouped-query attention (split over t), kv_lora_rank + qk_rope_head_dim for
    multi-head latent attention (replicated over t). The whole cache is this times the layers,
    the rows and the positions S (:class:`Sampling`'s ``max_len``)."""
    return _CACHES[cfg.attention].bytes_per_token(cfg)


@dataclasses.dataclass(frozen=True, eq=False)
class StopMatcher:
    """Stop conditions on what a row generates, as S automata over token ids, run on every
    row beside the decode loop; checked when made (ValueError).

        transitions  i32[S, V, Q]: automaton s's state after token v from state q
        accept       i32[S]: automaton s's accepting state, which it never leaves

    Each automaton starts in state 0 at the first new token (the prompt is not read); a row
    stops at the token that brings any automaton to its accepting state. :mod:`seqshard.sample`
    builds one per stop string of a byte-level tokenizer (a state: how many of the string's
    bytes the text ends with), so that a row stops at the token that completes the string.
    The table is replicated on every device: S * V * Q int32s.
    """

    transitions: np.ndarray
    accept: np.ndarray

    def __post_init__(self) -> None:
        table, accept = np.asarray(self.transitions), np.asarray(self.accept)
        if table.ndim != 3 or not np.issubdtype(table.dtype, np.integer) or 0 in table.shape:
            raise ValueError(
                f"StopMatcher: transitions must be non-empty integer states [S, V, Q], got "
                f"dtype {table.dtype} shape {table.shape}."
            )
        n, _, states = table.shape
        if accept.shape != (n,) or not np.issubdtype(accept.dtype, np.integer):
            raise ValueError(
                f"StopMatcher: accept must be {n} integer states (one per automaton), got "
                f"dtype {accept.dtype} shape {accept.shape}."
            )
        bad = (table < 0) | (table >= states)
        if bad.any() or ((accept < 0) | (accept >= states)).any():
            raise ValueError(
                f"StopMatcher: states must lie in [0, Q={states}), got transitions in "
                f"[{table.min()}, {table.max()}] and accept {accept.tolist()}."
            )
        object.__setattr__(self, "transitions", table.astype(np.int32))
        object.__setattr__(self, "accept", accept.astype(np.int32))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How :func:`generate` continues the prompts; checked when made (ValueError).

        Sampling(max_new_tokens=32, temperature=0.0)                       # greedy
        Sampling(max_new_tokens=32, temperature=0.8, top_k=40, key=jax.random.key(0))

    ``temperature`` 0 is greedy (argmax); otherwise sampling from softmax(logits /
    temperature), restricted to the ``top_k`` largest logits when given, with randomness from
    ``key`` (the same key gives the same tokens on any mesh). With ``stop_token``, a row that
    emits it emits only it from then on; with ``stop_matcher`` (:class:`StopMatcher`), a row
    also stops at the token its automata accept, and emits ``stop_token`` (0 without one)
    after it. Generation ends once every row has stopped. ``max_len``
    sizes the cache (default: the prompt width + max_new_tokens). ``return_logits``:
    :func:`generate` also returns f32[B, max_new_tokens, vocab], each new token's logits.
    What depends on the model or the prompt (top_k, stop_token and stop_matcher within the
    vocabulary, max_len against the prompt) :func:`generate` checks.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    key: jax.Array | None = None
    stop_token: int | None = None
    max_len: int | None = None
    return_logits: bool = False
    stop_matcher: StopMatcher | None = None

    def __post_init__(self) -> None:
        new, temperature = self.max_new_tokens, self.temperature
        if not isinstance(new, int) or new < 1:
            raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {new!r}.")
        if (
            not isinstance(temperature, (int, float))
            or not math.isfinite(temperature)
            or (temperature < 0)
        ):
            raise ValueError(
                f"generate: temperature must be a finite number >= 0 (0 is greedy), got "
                f"{temperature!r}."
            )
        if not self.greedy and self.key is None:
            raise ValueError(
                f"generate: sampling (temperature={temperature}) needs a key: pass "
                f"key=jax.random.key(seed), or temperature=0 for greedy decoding."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """What a compiled generator depends on besides array shapes (hashable: one jit per spec).

    Temperature and the key are traced arguments, so every temperature > 0 and every key
    shares one compilation; only greedy (temperature 0) is a different program.
    """

    cfg: ModelConfig
    mesh: Mesh
    max_new_tokens: int
    cache_len: int  # S: the positions the cache holds, >= prompt + max_new_tokens
    greedy: bool
    top_k: int | None  # None when greedy: the argmax needs no threshold
    stop_token: int | None
    stop_matcher: bool  # rows also stop where sampling.stop_matcher accepts (its table is traced)
    padded: bool  # some row is left-padded: the prefill mask is not plain causal
    return_logits: bool

    @property
    def cache(self) -> _Cache:
        """What the model's layers cache (its attention kind's)."""
        return _CACHES[self.cfg.attention]

    @property
    def cache_type(self) -> ArrayType:
        """The cache, in the matmuls' dtype."""
        return _CACHE_DTYPES[self.cfg.compute_dtype][self.cache.spec]


# ---------------------------------------------------------------------------------------------
# Choosing a mesh


def _fits(cfg: ModelConfig, d: int, t: int) -> bool:
    try:
        check_mesh(cfg, {"d": d, "t": t})
    except ValueError:
        return False
    return True


def decode_mesh(
    batch: int,
    cfg: ModelConfig,
    devices: Sequence[jax.Device] | None = None,
    *,
    max_d: int | None = None,
) -> Mesh:
    """A (d, t) mesh for generating ``batch`` rows: t as large as the model splits, then d.

    t comes first: a t split shards every weight with no weight traffic per token, while each
    decode step all-gathers all weights over d (the training layout is FSDP). d is then the
    largest divisor of ``batch`` (at most ``max_d``) for which the model still splits and
    d * t devices exist. Devices default to ``jax.devices()``; the first d * t are used.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"decode_mesh: batch must be a positive int, got {batch!r}.")
    if not devices:
        raise ValueError("decode_mesh: no devices given; pass a non-empty list of devices.")
    n = len(devices)
    t = max(t for t in range(1, n + 1) if _fits(cfg, 1, t))
    d_cap = min(batch, n // t, max_d if max_d is not None else batch)
    d = max(d for d in range(1, d_cap + 1) if batch % d == 0 and _fits(cfg, d, t))
    return mesh_of_sizes({"d": d, "t": t}, devices)


# ---------------------------------------------------------------------------------------------
# Per-device pieces (inside the shard_maps)


def _next_logits(cfg: ModelConfig, w: Weights, x: jax.Array) -> jax.Array:
    """The last residual 'B/dp M/t' -> final norm -> logits 'B/dp V/t' f32 (each t shard its block).

    A scope of its own: its L is 1, while the prompt around it binds L to the prompt length."""
    with shape_scope():
        return unembed(cfg, w, final_norm(cfg, w, x[:, None]))[:, 0]


def _sample(
    spec: DecodeSpec, logits: jax.Array, noise: jax.Array, temperature: jax.Array
) -> jax.Array:
    """Sample 'B/dp' ids from vocab-sharded logits 'B/dp V/t' without gathering the vocabulary."""
    vocab, top_k, block = spec.cfg.vocab, spec.top_k, logits.shape[-1]
    scores = logits
    if not spec.greedy:
        if top_k is not None and top_k < vocab:
            # The k-th largest logit of the whole vocab is among the shards' own k largest.
            local_top = lax.top_k(logits, min(top_k, block))[0]
            pool = shardops.all_gather("B/dp C/t -> B/dp C", local_top)
            kth = lax.top_k(pool, top_k)[0][:, -1:]
            scores = jnp.where(logits >= kth, logits, -jnp.inf)
        # Gumbel-max: argmax(logits / T + Gumbel noise) is a sample of softmax(logits / T).
        scores = scores / temperature + noise
    local_best = jnp.max(scores, axis=-1)
    local_id = jnp.argmax(scores, axis=-1).astype(jnp.int32) + shardops.axis_index("t") * block
    # The winner lives on one t shard: reduce this row's best score, then its id, over t.
    best = shardops.pmax("B/dp{U_t} -> B/dp", local_best)
    # On a tie across shards the lowest id wins (max of the negated ids), as jnp.argmax.
    neg_id = jnp.where(local_best == best, -local_id, -vocab)
    return -shardops.pmax("B/dp{U_t} -> B/dp", neg_id)


def _stacks(cfg, w: Weights) -> list:
    """(each layer stack's blocks, its stacked weights), in the order the residual passes
    them (:func:`~seqshard.model.layers.stacks`)."""
    return [(s.blocks, getattr(w, s.name)) for s in stacks(cfg)]


def _prefill_layer(
    spec: DecodeSpec, blocks, rope, mask: jax.Array, x: jax.Array, w
) -> tuple[jax.Array, jax.Array]:
    """One layer on the prompt's residual 'B/dp L@zigzag/c M/t'; also its cache entries (one
    layer's cache with L for S)."""
    cfg = spec.cfg
    a = Activations(blocks[:1], {"x": x})  # the layer's attention block
    entry = spec.cache.entry(cfg, w, a, rope)
    keys, values = gathered_kv(a["k"], a["v"])  # c = 1: k and v themselves, typed as every key
    # Without padding the mask is exactly causal, which fused kernels take as is_causal.
    impl, causal_only = cfg.attention_impl, not spec.padded
    a("attn", lambda: attention(a["q"], keys, values, mask, impl, causal_only))
    return after_attention(cfg, blocks, w, attention_block.attention_output(cfg, w, a)), entry


def _prefill(
    spec: DecodeSpec,
    w: Weights,
    prompt: jax.Array,
    start: jax.Array,
    noise: jax.Array,
    temperature: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per device: the prompt 'B/dp L@zigzag/c' (row b's first real token at start[b]) -> the first new
    token 'B/dp', its logits 'B/dp V/t' and the cache (``spec.cache_type``)."""
    cfg = spec.cfg
    length = prompt.shape[1]
    index = jnp.arange(length, dtype=jnp.int32)
    # Row b's first real token is at index start[b]: RoPE position 0 there.
    positions = jnp.maximum(index[None, :] - start[:, None], 0)
    rope = rope_cos_sin(cfg, positions)
    real_key = index[None, None, :] >= start[:, None, None]
    # A padding query attends to itself only, so no softmax row is empty (fused kernels
    # would give NaN there, and padding's cache entries must stay finite).
    diagonal = (index[:, None] == index[None, :])[None]
    causal = (index[:, None] >= index[None, :])[None]
    mask = causal & (real_key | diagonal)
    x = embed(cfg, w, prompt)
    kv = []
    for blocks, stack in _stacks(cfg, w):
        body = functools.partial(_prefill_layer, spec, blocks, rope, mask)
        x, stack_kv = lax.scan(body, x, stack)
        kv.append(stack_kv)
    kv = jnp.concatenate(kv) if len(kv) > 1 else kv[0]
    # kv: the cache with L for S, every stack's layers in order; the cache holds S positions,
    # the rest filled by decode.
    pad = [(0, 0)] * kv.ndim
    pad[spec.cache.seq_axis] = (0, spec.cache_len - length)
    kv = jnp.pad(kv, pad)
    logits = _next_logits(cfg, w, x[:, -1])
    return _sample(spec, logits, noise, temperature), logits, kv


def _decode_layer(
    spec: DecodeSpec, blocks, rope, mask: jax.Array, index: jax.Array, carry, xs
) -> tuple[tuple[jax.Array, jax.Array], None]:
    """One layer on the fed token's residual 'B/dp 1 M/t', writing its entry into the cache."""
    cfg = spec.cfg
    x, kv = carry
    w, layer = xs
    a = Activations(blocks[:1], {"x": x})  # the layer's attention block
    new = spec.cache.entry(cfg, w, a, rope)[None].astype(kv.dtype)  # a layer's cache, L = 1
    # Write this token's entry in place at cache index `index`, then read the layer's cache.
    at = [jnp.int32(0)] * kv.ndim
    at[0], at[spec.cache.seq_axis] = layer, index
    kv = lax.dynamic_update_slice(kv, new, at)
    h = spec.cache.decode(cfg, w, a, lax.dynamic_index_in_dim(kv, layer, keepdims=False), mask)
    return (after_attention(cfg, blocks, w, h), kv), None


def _decode_step(
    spec: DecodeSpec,
    w: Weights,
    kv: jax.Array,
    token: jax.Array,
    index: jax.Array,
    start: jax.Array,
    noise: jax.Array,
    temperature: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per device: feed token 'B/dp' at cache index ``index`` -> the next token 'B/dp', its
    logits 'B/dp V/t' and the cache (``spec.cache_type``) holding the fed token's entry."""
    cfg = spec.cfg
    rope = rope_cos_sin(cfg, (index - start)[:, None])
    keys = jnp.arange(spec.cache_len, dtype=jnp.int32)
    # Keys from the row's first real token up to and including this one.
    mask = ((keys[None, :] >= start[:, None]) & (keys[None, :] <= index))[:, None, :]
    x = embed(cfg, w, token[:, None])
    first = 0  # the cache's index of the stack's first layer
    for blocks, stack in _stacks(cfg, w):
        body = functools.partial(_decode_layer, spec, blocks, rope, mask, index)
        n = jax.tree.leaves(stack)[0].shape[0]
        layers = jnp.arange(first, first + n, dtype=jnp.int32)
        (x, kv), _ = lax.scan(body, (x, kv), (stack, layers))
        first += n
    logits = _next_logits(cfg, w, x[:, 0])
    return _sample(spec, logits, noise, temperature), logits, kv


# ---------------------------------------------------------------------------------------------
# The shard_maps and the decode loop, jitted once per DecodeSpec


def _shard_mapped(spec: DecodeSpec) -> tuple[Callable, Callable]:
    """:func:`_prefill` and :func:`_decode_step` as shard_maps on ``spec.mesh``, typed here
    (the cache's dtype is the spec's)."""
    kv_type = spec.cache_type

    def prefill(
        w: Weights,
        prompt: i32[b"B/dp L@zigzag/c"],
        start: i32[b"B/dp"],
        noise: f32[b"B/dp V/t"],
        temperature: f32[()],
    ) -> tuple[i32[b"B/dp"], f32[b"B/dp V/t"], kv_type]:
        return _prefill(spec, w, prompt, start, noise, temperature)

    def decode_step(
        w: Weights,
        kv: kv_type,
        token: i32[b"B/dp"],
        index: i32[()],
        start: i32[b"B/dp"],
        noise: f32[b"B/dp V/t"],
        temperature: f32[()],
    ) -> tuple[i32[b"B/dp"], f32[b"B/dp V/t"], kv_type]:
        return _decode_step(spec, w, kv, token, index, start, noise, temperature)

    for fn in (prefill, decode_step):  # the weights' class is the config's
        fn.__annotations__["w"] = weights_type(spec.cfg)
    return typed_shard_map(prefill, mesh=spec.mesh), typed_shard_map(decode_step, mesh=spec.mesh)


def _run(
    spec: DecodeSpec,
    weights: Weights,
    prompt: jax.Array,
    start: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    matcher: tuple[jax.Array, jax.Array] | None,
) -> tuple[jax.Array, jax.Array | None]:
    """Prefill, then decode steps until max_new_tokens or every row has stopped: the new tokens
    i32[B, max_new_tokens], and their logits f32[B, max_new_tokens, V] if asked for.
    ``matcher``: a :class:`StopMatcher`'s transitions i32[S, V, Q] and accept i32[S]."""
    cfg, max_new_tokens, stop_token = spec.cfg, spec.max_new_tokens, spec.stop_token
    prefill, decode_step = _shard_mapped(spec)
    batch, length = prompt.shape
    noise_sharding = shardings(f32[b"B/dp V/t"], spec.mesh)

    def noise(step):
        if spec.greedy:
            return jnp.zeros((batch, cfg.vocab), jnp.float32)
        g = jax.random.gumbel(jax.random.fold_in(key, step), (batch, cfg.vocab), jnp.float32)
        return lax.with_sharding_constraint(g, noise_sharding)

    fill = 0 if stop_token is None else stop_token

    def stopped(token, done, matched):
        """A row that has stopped emits ``fill``; it stops at stop_token or where the matcher
        accepts (``matched``: each automaton's state, i32[B, S])."""
        token = jnp.where(done, fill, token)
        if stop_token is not None:
            done = done | (token == stop_token)
        if matched is not None:
            transitions, accept = matcher
            matched = transitions[jnp.arange(len(accept))[None, :], token[:, None], matched]
            done = done | jnp.any(matched == accept[None, :], axis=1)
        return token, done, matched

    token, logits, kv = prefill(weights, prompt, start, noise(0), temperature)
    matched = None if matcher is None else jnp.zeros((batch, len(matcher[1])), jnp.int32)
    token, done, matched = stopped(token, jnp.zeros((batch,), jnp.bool_), matched)
    out = jnp.full((batch, max_new_tokens), fill, jnp.int32).at[:, 0].set(token)
    seen = None
    if spec.return_logits:
        seen = jnp.zeros((batch, max_new_tokens, cfg.vocab), jnp.float32)
        seen = seen.at[:, 0].set(logits)

    def cond(state):
        step, _, _, _, _, done, _ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, token, kv, out, seen, done, matched = state
        # new token `step - 1` goes into the cache right after the prompt and its followers.
        index = length + step - 1
        token, logits, kv = decode_step(weights, kv, token, index, start, noise(step), temperature)
        token, done, matched = stopped(token, done, matched)
        out = lax.dynamic_update_index_in_dim(out, token, step, axis=1)
        if seen is not None:
            seen = lax.dynamic_update_index_in_dim(seen, logits, step, axis=1)
        return step + 1, token, kv, out, seen, done, matched

    state = (jnp.int32(1), token, kv, out, seen, done, matched)
    _, _, _, out, seen, _, _ = lax.while_loop(cond, body, state)
    return out, seen


@functools.lru_cache(maxsize=32)
def _decoder(spec: DecodeSpec) -> Callable:
    """The jitted :func:`_run` of one spec, built once; jit compiles it once per prompt shape."""
    return jax.jit(functools.partial(_run, spec))


# ---------------------------------------------------------------------------------------------
# Checking the arguments


def _check_prompt(
    prompt_tokens, prompt_lengths, cfg: ModelConfig, d: int
) -> tuple[np.ndarray, np.ndarray]:
    """The prompt with padding zeroed, and each row's first real index, as numpy int32."""
    prompt = np.asarray(prompt_tokens)
    if prompt.ndim != 2 or prompt.shape[1] < 1 or prompt.shape[0] < 1:
        raise ValueError(
            f"generate: prompt_tokens must be a 2-D [batch, prompt_len] array with at least one "
            f"row and one token, got shape {prompt.shape}. Wrap a single prompt as [ids]."
        )
    if prompt.dtype == np.bool_ or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"generate: prompt_tokens must be integer ids, got dtype {prompt.dtype}.")
    batch, length = prompt.shape
    if batch % d:
        raise ValueError(
            f"generate: batch {batch} cannot be split over the mesh's d={d}. Use "
            f"mesh=decode_mesh({batch}, cfg), or pad the batch to a multiple of {d} rows."
        )
    if prompt_lengths is None:
        lengths = np.full((batch,), length, np.int64)
    else:
        lengths = np.asarray(prompt_lengths)
        if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"generate: prompt_lengths must be {batch} ints (one per row), got "
                f"{prompt_lengths!r}."
            )
        bad = np.flatnonzero((lengths < 1) | (lengths > length))
        if bad.size:
            raise ValueError(
                f"generate: prompt_lengths[{bad[0]}] = {lengths[bad[0]]} is outside [1, "
                f"{length}]: each row needs at least one real token, left-padded to the "
                f"prompt width {length}."
            )
    start = (length - lengths).astype(np.int32)
    real = np.arange(length)[None, :] >= start[:, None]
    outside = real & ((prompt < 0) | (prompt >= cfg.vocab))
    if outside.any():
        row, col = np.argwhere(outside)[0]
        raise ValueError(
            f"generate: prompt_tokens[{row}, {col}] = {prompt[row, col]} is not a token id of "
            f"the model's vocabulary [0, {cfg.vocab}). Encode with the tokenizer the model was "
            f"trained with (model.vocab >= its vocabulary size)."
        )
    return np.where(real, prompt, 0).astype(np.int32), start


def _check_mesh(cfg: ModelConfig, mesh: Mesh) -> None:
    """The mesh is a (d, t) mesh the model splits over."""
    if not isinstance(mesh, Mesh) or set(mesh.axis_names) != set(AXES):
        raise ValueError(
            f"generate: mesh must be a jax.sharding.Mesh with axes {AXES}, got "
            f"{getattr(mesh, 'shape', mesh)!r}. Make one with decode_mesh(batch, cfg)."
        )
    if axis_size(mesh, "p") != 1:
        raise ValueError(
            f"generate: mesh axis p (pipeline) has size {axis_size(mesh, 'p')}, but generation runs "
            f"every layer on each device's rows and needs p = 1. Make the mesh with "
            f"decode_mesh(batch, cfg) (weights trained with p > 1 load on it)."
        )
    if axis_size(mesh, "c") != 1:
        raise ValueError(
            f"generate: mesh axis c (context) has size {axis_size(mesh, 'c')}, but generation keeps "
            f"each row's cache whole on a device and needs c = 1. Make the mesh with "
            f"decode_mesh(batch, cfg) (axes d and t; weights trained with c > 1 load on it)."
        )
    check_mesh(cfg, dict(mesh.shape))


def _check_vocab(sampling: Sampling, vocab: int) -> None:
    """``sampling``'s top_k, stop_token and stop_matcher within the model's vocabulary."""
    top_k, stop_token, matcher = sampling.top_k, sampling.stop_token, sampling.stop_matcher
    if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise ValueError(
            f"generate: top_k must be None or an int in [1, vocab={vocab}], got {top_k!r}."
        )
    if stop_token is not None and (not isinstance(stop_token, int) or not 0 <= stop_token < vocab):
        raise ValueError(
            f"generate: stop_token must be None or an id in [0, {vocab}), got {stop_token!r}."
        )
    if matcher is not None and not isinstance(matcher, StopMatcher):
        raise TypeError(
            f"generate: stop_matcher must be None or a StopMatcher, got {type(matcher).__name__}."
        )
    if matcher is not None and matcher.transitions.shape[1] != vocab:
        raise ValueError(
            f"generate: stop_matcher.transitions has a state for {matcher.transitions.shape[1]} "
            f"token ids, but the model's vocabulary has {vocab}; make it for model.vocab ids "
            f"(seqshard.sample builds one from the tokenizer and the model's vocab)."
        )


def _cache_len(sampling: Sampling, length: int) -> int:
    """S: the positions the cache holds, for a prompt of ``length`` tokens."""
    new, max_len = sampling.max_new_tokens, sampling.max_len
    cache_len = length + new if max_len is None else max_len
    if not isinstance(cache_len, int) or length + new > cache_len:
        raise ValueError(
            f"generate: the prompt ({length} tokens) plus max_new_tokens={new} needs "
            f"a cache of {length + new} positions, but max_len={max_len!r}. Raise "
            f"max_len, shorten the prompt, or ask for fewer tokens."
        )
    return cache_len


def _checked(
    weights: Weights,
    prompt_tokens,
    cfg: ModelConfig,
    mesh: Mesh,
    sampling: Sampling,
    prompt_lengths: Sequence[int] | None,
) -> tuple[DecodeSpec, np.ndarray, np.ndarray, jax.Array]:
    """Every check of :func:`generate`'s arguments, before anything compiles: the spec, the
    prompt i32[B, P] with padding zeroed, each row's first real index i32[B], and the key."""
    _check_mesh(cfg, mesh)
    expected = weights_type(cfg)
    if not isinstance(weights, expected):
        raise TypeError(
            f"generate: weights must be a {expected.__name__} for this config, got "
            f"{type(weights).__name__}."
        )
    if not isinstance(sampling, Sampling):
        raise TypeError(f"generate: sampling must be a Sampling, got {type(sampling).__name__}.")
    _check_vocab(sampling, cfg.vocab)
    prompt, start = _check_prompt(prompt_tokens, prompt_lengths, cfg, axis_size(mesh, "d"))
    spec = DecodeSpec(
        # A decode step feeds one token per row: nothing to split over t in L. Whatever the
        # training layout, the residual is 'B/dp L@zigzag/c M/t' here (the same model and weights).
        cfg=dataclasses.replace(cfg, residual="M/t"),
        mesh=mesh,
        max_new_tokens=sampling.max_new_tokens,
        cache_len=_cache_len(sampling, prompt.shape[1]),
        greedy=sampling.greedy,
        top_k=None if sampling.greedy else sampling.top_k,
        stop_token=sampling.stop_token,
        stop_matcher=sampling.stop_matcher is not None,
        padded=bool((start > 0).any()),
        return_logits=bool(sampling.return_logits),
    )
    key = jax.random.key(0) if sampling.key is None else sampling.key
    return spec, prompt, start, key


def generate(
    weights: Weights,
    prompt_tokens,
    cfg: ModelConfig,
    mesh: Mesh,
    sampling: Sampling,
    *,
    prompt_lengths: Sequence[int] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Continue each prompt by ``sampling.max_new_tokens`` tokens: i32[B, P + max_new_tokens].

    ``prompt_tokens``: integer ids [B, P], each row a document from position 0. Rows shorter
    than P are left-padded: row b's prompt is ``prompt_tokens[b, P - prompt_lengths[b]:]``
    (padding values are ignored). The output is the prompt as given, then the new tokens.

    How the tokens are chosen, and where each row stops, is ``sampling``'s (:class:`Sampling`).
    ``weights`` may live on any mesh; they are resharded onto ``mesh``, whose d must divide B
    (see :func:`decode_mesh`). With ``sampling.return_logits`` the result is a pair: the
    tokens and f32[B, max_new_tokens, vocab], each new token's logits.
    """
    spec, prompt, start, key = _checked(weights, prompt_tokens, cfg, mesh, sampling, prompt_lengths)
    weights = jax.device_put(weights, shardings(weights_type(cfg), mesh))
    temperature = jnp.float32(sampling.temperature)
    matcher = sampling.stop_matcher
    if matcher is not None:
        matcher = (jnp.asarray(matcher.transitions), jnp.asarray(matcher.accept))
    new, seen = _decoder(spec)(weights, prompt, start, key, temperature, matcher)
    tokens = jnp.concatenate([jnp.asarray(prompt_tokens).astype(jnp.int32), new], axis=1)
    return (tokens, seen) if spec.return_logits else tokens
