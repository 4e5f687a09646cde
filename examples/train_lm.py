"""Train a small byte-level Mixture-of-Experts language model on the Python standard library.

A decoder-only transformer (Flax NNX) whose MLPs are `mok_jax.nn.flax.MoE` layers, trained on
the `.py` files of this Python's own standard library (found with `sysconfig`; no download),
split by file into training and held-out sets. The defaults run in a few minutes on a 2-core
CPU:

    python examples/train_lm.py

It shows a progress bar (loss, tokens/s, step time), evaluates the held-out loss at intervals,
saves checkpoints (orbax) it can `--resume` from, writes a plot of the losses and the
per-expert load, compares the held-out loss with the unigram byte entropy of the corpus (both
in nats per byte; bits in parentheses) and prints a sample. Everything goes under --out.

Expert parallelism: `--ep N` splits the experts over N devices (a mesh ("data", "expert") of
all devices); on a CPU the script makes N host devices itself. On a GPU, `--dtype auto` computes
in bfloat16 so that `--backend auto` can pick the CUDA kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import sysconfig
import time
import zlib

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  g = p.add_argument_group("model")
  g.add_argument("--d-model", type=int, default=128, help="model width H")
  g.add_argument("--layers", type=int, default=2)
  g.add_argument("--heads", type=int, default=4)
  g.add_argument("--experts", type=int, default=8, help="routed experts E per layer")
  g.add_argument("--top-k", type=int, default=2, help="experts per token")
  g.add_argument("--expert-size", type=int, default=128, help="expert intermediate size I")
  g.add_argument("--shared-size", type=int, default=0,
                 help="shared-expert intermediate size (0: no shared expert)")
  g.add_argument("--score", choices=("softmax", "sigmoid"), default="softmax")
  g.add_argument("--seq-len", type=int, default=128)
  g.add_argument("--scan-layers", action="store_true",
                 help="stack the blocks' parameters on a leading axis and run them with nnx.scan "
                      "(one compiled block, as large models are trained) instead of a loop")
  g = p.add_argument_group("training")
  g.add_argument("--steps", type=int, default=500)
  g.add_argument("--batch", type=int, default=16, help="sequences per step")
  g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, cosine)")
  g.add_argument("--warmup", type=int, default=50)
  g.add_argument("--lb-coef", type=float, default=1e-2, help="load-balancing loss weight")
  g.add_argument("--z-coef", type=float, default=1e-3, help="router z-loss weight")
  g.add_argument("--bias-rate", type=float, default=0.0,
                 help="aux-loss-free balancing: selection-bias update rate (0: off)")
  g.add_argument("--seed", type=int, default=0)
  g = p.add_argument_group("execution")
  g.add_argument("--backend", choices=("auto", "xla", "ffi", "cuda"), default="auto",
                 help="mok_jax.moe backend")
  g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                 help="compute dtype; auto: bfloat16 on a GPU, float32 on a CPU")
  g.add_argument("--ep", type=int, default=1, help="expert-parallel devices")
  g.add_argument("--precision", choices=("bf16", "fp8", "mxfp8"), default="bf16",
                 help="the expert products' numerics (mok_jax.Config.precision): fp8 in the "
                 "CUDA kernels and the C++ CPU target (d-model, expert-size, shared-size "
                 "multiples of 128), mxfp8 on the xla backend")
  g = p.add_argument_group("output")
  g.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/train_lm"))
  g.add_argument("--ckpt-dir", type=pathlib.Path, default=None, help="default: OUT/ckpt")
  g.add_argument("--ckpt-every", type=int, default=200)
  g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  g.add_argument("--eval-every", type=int, default=100)
  g.add_argument("--eval-batches", type=int, default=8)
  g.add_argument("--sample-len", type=int, default=300, help="bytes to generate at the end")
  g.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  if args.ckpt_dir is None:
    args.ckpt_dir = args.out / "ckpt"
  return args


def set_host_devices(ep: int):
  """--ep N on a CPU needs N host devices. XLA reads the flag when JAX starts its backends, so
  this must run before `import jax` (it is harmless on a GPU)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if ep > 1 and HOST_DEVICES_FLAG not in flags and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={ep}".strip()


if __name__ == "__main__":
  set_host_devices(parse_args().ep)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

import mok_jax  # noqa: E402
from mok_jax.nn.flax import MoE  # noqa: E402

ARCH_FLAGS = ("d_model", "layers", "heads", "experts", "top_k", "expert_size", "shared_size",
              "score", "seq_len", "scan_layers")
DOC_SEPARATOR = 0  # byte between files; never in a .py file


# --- data --------------------------------------------------------------------------------------


def load_corpus():
  """(train bytes, held-out bytes, number of files of each): every stdlib .py file, about 1 in
  10 held out, chosen by a hash of its path so the split is the same on every run."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages"}
  files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
  if not files:
    raise SystemExit(f"no .py files under the standard library directory {root}")
  parts = {True: [], False: []}
  for path in files:
    held_out = zlib.crc32(str(path.relative_to(root)).encode()) % 10 == 0
    parts[held_out].append(path.read_bytes() + bytes([DOC_SEPARATOR]))
  as_array = lambda chunks: np.frombuffer(b"".join(chunks), np.uint8)  # noqa: E731
  return as_array(parts[False]), as_array(parts[True]), len(parts[False]), len(parts[True])


def unigram_entropy(data) -> float:
  """Entropy of the byte distribution, in nats per byte (the unit of the loss)."""
  p = np.bincount(data, minlength=256) / len(data)
  p = p[p > 0]
  return float(-np.sum(p * np.log(p)))


def batch_at(data, step, batch, seq_len, seed):
  """(batch, seq_len + 1) windows at offsets drawn from (seed, step): a resumed run sees the
  same batches as an uninterrupted one."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(data) - seq_len - 1, batch)
  return np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


# --- model -------------------------------------------------------------------------------------


class Block(nnx.Module):
  """Pre-norm block: causal self-attention, then an MoE in place of the MLP."""

  def __init__(self, args, mesh, dtype, rngs):
    d = args.d_model
    self.heads = args.heads
    self.attn_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
    self.qkv = nnx.Linear(d, 3 * d, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs,
                          kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2 * args.layers)))
    self.moe_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
    self.moe = MoE(d, args.expert_size, args.experts, args.top_k, score=args.score,
                   shared_intermediate_size=args.shared_size or None,
                   selection_bias=args.bias_rate > 0, dtype=dtype, backend=args.backend,
                   config=mok_jax.Config(precision=args.precision), mesh=mesh,
                   expert_axis="expert" if mesh is not None else None, rngs=rngs)

  def __call__(self, x):
    B, S, d = x.shape
    q, k, v = jnp.split(self.qkv(self.attn_norm(x)), 3, axis=-1)
    q, k, v = (a.reshape(B, S, self.heads, d // self.heads) for a in (q, k, v))
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + self.out(a.reshape(B, S, d))
    y, aux = self.moe(self.moe_norm(x))
    return x + y.astype(x.dtype), aux


class LM(nnx.Module):
  """Byte embeddings + learned positions, blocks, and logits tied to the embeddings."""

  def __init__(self, args, mesh, dtype, rngs):
    self.dtype = dtype
    self.embed = nnx.Embed(256, args.d_model, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (args.seq_len, args.d_model)))
    self.scan_layers = args.scan_layers
    if args.scan_layers:
      # One Block whose parameters have a leading layer axis (the experts stay split over the
      # mesh's "expert" axis, the layer axis whole).
      @nnx.split_rngs(splits=args.layers)
      @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
      def stacked(rngs):
        return Block(args, mesh, dtype, rngs)
      self.blocks = stacked(rngs)
    else:
      blocks = [Block(args, mesh, dtype, rngs) for _ in range(args.layers)]
      self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks  # Flax < 0.12: a list
    self.norm = nnx.RMSNorm(args.d_model, rngs=rngs)

  def __call__(self, tokens):
    """tokens (B, S) int -> logits (B, S, 256) f32 and the MoEAux of the layers, stacked on a
    leading axis."""
    x = (self.embed(tokens) + self.pos[...][: tokens.shape[1]]).astype(self.dtype)
    if self.scan_layers:
      x, auxes = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0),
                          out_axes=(nnx.Carry, 0))(x, self.blocks)
    else:
      auxes = []
      for block in self.blocks:
        x, aux = block(x)
        auxes.append(aux)
      auxes = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
    logits = self.embed.attend(self.norm(x.astype(jnp.float32)))
    return logits, auxes


# --- training ----------------------------------------------------------------------------------


def make_train_step(args):
  @nnx.jit
  def train_step(model, optimizer, batch):
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def loss_fn(model):
      logits, auxes = model(inputs)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
      lb, z = jnp.mean(auxes.load_balancing_loss), jnp.mean(auxes.router_z_loss)
      return ce + args.lb_coef * lb + args.z_coef * z, (ce, auxes.counts)  # counts (layers, E)

    (_, (ce, counts)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    if args.bias_rate > 0 and args.scan_layers:
      model.blocks.moe.update_bias(counts, args.bias_rate)  # each layer's row of the stack
    elif args.bias_rate > 0:
      for block, c in zip(model.blocks, counts):
        block.moe.update_bias(c, args.bias_rate)
    return ce, counts

  return train_step


@nnx.jit
def eval_loss(model, batch):
  logits, _ = model(batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def generate(model, prompt: bytes, n: int, seq_len: int, key, temperature=0.8) -> bytes:
  """n bytes sampled after prompt, recomputing a fixed (1, seq_len) window every step."""
  next_logits = nnx.jit(lambda m, buf, i: m(buf)[0][0, i])
  out = list(prompt)
  for _ in range(n):
    window = out[-seq_len:]
    buf = jnp.asarray([window + [0] * (seq_len - len(window))], jnp.int32)
    key, sub = jax.random.split(key)
    logits = next_logits(model, buf, len(window) - 1)
    out.append(int(jax.random.categorical(sub, logits / temperature)))
  return bytes(out)


def plot(path, history, entropy, experts):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax, ax_load) = plt.subplots(2, 1, figsize=(9, 8), height_ratios=(3, 2))
  steps, train = zip(*history["train"]) if history["train"] else ((), ())
  ax.plot(steps, train, alpha=0.3, color="C0", label="train (per step)")
  if len(train) > 10:
    w = max(len(train) // 30, 5)
    smooth = np.convolve(train, np.ones(w) / w, mode="valid")
    ax.plot(steps[w - 1:], smooth, color="C0", label=f"train (mean of {w})")
  if history["eval"]:
    ax.plot(*zip(*history["eval"]), "o-", color="C1", label="held-out")
  ax.axhline(entropy, ls="--", color="gray", label="unigram byte entropy")
  ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="byte-level MoE LM on stdlib")
  ax.legend()
  if history["load"]:
    load_steps = [s for s, _ in history["load"]]
    load = np.array([c for _, c in history["load"]], np.float64)  # (n, layers, E)
    share = load / load.sum(-1, keepdims=True) * experts  # 1 = balanced
    layers = share.shape[1]
    image = share.reshape(len(load_steps), -1).T  # (layers * E, n)
    im = ax_load.imshow(image, aspect="auto", interpolation="nearest", cmap="viridis",
                        extent=(load_steps[0], load_steps[-1], layers * experts - 0.5, -0.5))
    for layer in range(1, layers):
      ax_load.axhline(layer * experts - 0.5, color="white", lw=1)
    ax_load.set(xlabel="step", ylabel="layer x expert",
                title="per-expert load (routes / uniform share; 1 = balanced)")
    fig.colorbar(im, ax=ax_load)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def checkpoint_manager(args):
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  return ocp.CheckpointManager(args.ckpt_dir.absolute(), options=options)


def save(mngr, step, model, optimizer, meta):
  mngr.save(step, args=ocp.args.Composite(
      model=ocp.args.StandardSave(nnx.state(model)),
      optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
      meta=ocp.args.JsonSave(meta)))


def restore(mngr, model, optimizer, args):
  """Loads the latest checkpoint into model and optimizer; returns its metadata."""
  step = mngr.latest_step()
  if step is None:
    raise SystemExit(f"--resume: no checkpoint in {args.ckpt_dir}")
  meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  saved = meta["arch"]
  mine = {k: getattr(args, k) for k in ARCH_FLAGS}
  if saved != mine:
    diff = {k: (saved.get(k), mine[k]) for k in mine if saved.get(k) != mine[k]}
    raise SystemExit(f"--resume: the checkpoint in {args.ckpt_dir} has another architecture "
                     f"(flag: (checkpoint, now)): {diff}")
  restored = mngr.restore(step, args=ocp.args.Composite(
      model=ocp.args.StandardRestore(nnx.state(model)),
      optimizer=ocp.args.StandardRestore(nnx.state(optimizer))))
  nnx.update(model, restored["model"])
  nnx.update(optimizer, restored["optimizer"])
  return meta


def main(argv=None):
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  if args.ep > jax.device_count():
    raise SystemExit(f"--ep {args.ep}: only {jax.device_count()} device(s); on a CPU run this "
                     "script as a program (it sets XLA_FLAGS=--xla_force_host_platform_device_"
                     f"count={args.ep} before JAX starts)")
  if args.experts % args.ep:
    raise SystemExit(f"--experts {args.experts} is not divisible by --ep {args.ep}")
  if args.d_model % args.heads:
    raise SystemExit(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
  on_gpu = jax.default_backend() == "gpu"
  dtype = {"auto": jnp.bfloat16 if on_gpu else jnp.float32, "float32": jnp.float32,
           "bfloat16": jnp.bfloat16}[args.dtype]

  t0 = time.perf_counter()
  train, held_out, n_train, n_held = load_corpus()
  entropy = unigram_entropy(train)
  print(f"corpus: {n_train} training files ({len(train) / 1e6:.1f} MB), {n_held} held-out files "
        f"({len(held_out) / 1e6:.1f} MB), read in {time.perf_counter() - t0:.1f}s")
  print(f"unigram byte entropy of the training corpus: {entropy:.3f} nats/byte "
        f"({entropy / math.log(2):.3f} bits/byte); losses below are in nats/byte")

  mesh = None
  if args.ep > 1:
    n = jax.device_count() // args.ep * args.ep
    # Auto axes: XLA partitions the rest of the model around the MoE layers' shard_map.
    mesh = jax.make_mesh((n // args.ep, args.ep), ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:n])
  model = LM(args, mesh, dtype, nnx.Rngs(args.seed))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  per_expert = 3 * args.d_model * args.expert_size
  active = n_params - args.layers * (args.experts - args.top_k) * per_expert
  print(f"model: {args.layers} layers, d_model {args.d_model}, {args.experts} experts (top "
        f"{args.top_k}, size {args.expert_size}); {n_params / 1e6:.2f}M parameters, "
        f"{active / 1e6:.2f}M active per token; {jnp.dtype(dtype).name} on "
        f"{jax.default_backend()}" + (f", experts over {args.ep} devices" if mesh else ""))
  warmup = min(args.warmup, args.steps // 5)  # short runs (tests) still decay
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1),
                                                end_value=args.lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b2=0.98, weight_decay=0.1))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  if mesh is not None:
    # Commit every array to the mesh: the MoE experts are split over "expert" already, the
    # rest is replicated. (Fresh arrays float on device 0; restored ones would be committed
    # there, and jit refuses to mix them with arrays on the mesh.)
    for obj in (model, optimizer):
      state = nnx.state(obj)
      nnx.update(obj, jax.device_put(state, nnx.get_named_sharding(state, mesh)))

  mngr = checkpoint_manager(args)
  history = {"train": [], "eval": [], "load": []}
  start = 0
  if args.resume:
    meta = restore(mngr, model, optimizer, args)
    start, history = meta["step"], meta["history"]
    print(f"resumed from {args.ckpt_dir} at step {start}")

  eval_batches = [batch_at(held_out, i, args.batch, args.seq_len, args.seed + 1)
                  for i in range(args.eval_batches)]

  def evaluate():
    return float(np.mean([eval_loss(model, b) for b in eval_batches]))

  def checkpoint(step):
    meta = {"step": step, "history": history, "arch": {k: getattr(args, k) for k in ARCH_FLAGS}}
    save(mngr, step, model, optimizer, meta)

  train_step = make_train_step(args)
  tokens_per_step = args.batch * args.seq_len
  bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=args.no_progress,
             unit="step", dynamic_ncols=True)
  t_train = time.perf_counter()
  step_times = []
  for step in bar:
    batch = batch_at(train, step, args.batch, args.seq_len, args.seed)
    t = time.perf_counter()
    ce, counts = train_step(model, optimizer, batch)
    ce = float(ce)  # waits for the step
    dt = time.perf_counter() - t
    step_times.append(dt)
    history["train"].append((step + 1, ce))
    history["load"].append((step + 1, np.asarray(counts).tolist()))
    bar.set_postfix(loss=f"{ce:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                    step_ms=f"{dt * 1e3:.0f}")
    done = step + 1
    if done % args.eval_every == 0 or done == args.steps:
      history["eval"].append((done, evaluate()))
      bar.write(f"step {done}: train {ce:.3f}, held-out {history['eval'][-1][1]:.3f} nats/byte")
    if done % args.ckpt_every == 0 or done == args.steps:
      checkpoint(done)
  bar.close()
  mngr.wait_until_finished()
  train_s = time.perf_counter() - t_train

  plot(args.out / "train_lm.png", history, entropy, args.experts)
  if not history["eval"]:
    history["eval"].append((start, evaluate()))
  final = history["eval"][-1][1]
  verdict = "below" if final < entropy else "NOT below"
  print(f"trained steps {start}..{args.steps} in {train_s:.0f}s; held-out loss {final:.3f} "
        f"nats/byte ({final / math.log(2):.3f} bits) is {verdict} the unigram entropy "
        f"{entropy:.3f} nats/byte ({entropy / math.log(2):.3f} bits)")
  print(f"plot: {args.out / 'train_lm.png'}; checkpoints: {args.ckpt_dir}")
  if args.sample_len > 0:
    text = generate(model, b"def ", args.sample_len, args.seq_len, jax.random.key(args.seed))
    print("sample:\n" + text.decode("utf-8", errors="replace"))
  summary = {"steps": args.steps, "start": start, "train_seconds": train_s,
             "median_step_ms": float(np.median(step_times) * 1e3) if step_times else None,
             "final_train_loss": history["train"][-1][1] if history["train"] else None,
             "final_held_out_loss": final, "unigram_entropy": entropy, "units": "nats/byte"}
  (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
  (args.out / "history.json").write_text(json.dumps(history))
  return summary


if __name__ == "__main__":
  main()
