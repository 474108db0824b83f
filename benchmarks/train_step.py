"""Training step (forward, backward, AdamW) of a small Llama-style model on the CPU, as built
by Hugging Face transformers (random weights), unpatched against rmsnorm.torch.patch, with the
share of the step spent in the RMSNorm modules (forward and backward) before and after.

    python benchmarks/train_step.py --threads 1 2
    python benchmarks/train_step.py --threads 16 --hidden 1024 --layers 8

Steps of the two models alternate and the median is reported. The share comes from separate
steps with timing hooks on the norm modules (forward hooks and full backward hooks), whose
step time is also printed so that the hooks' own cost is visible.
"""

import argparse
import copy
import platform
import statistics
import time

import torch
import transformers

import rmsnorm
import rmsnorm.torch as rt


def build(args):
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype)).train()
    return model


def norm_modules(model):
    return [m for m in model.modules() if "RMSNorm" in type(m).__name__]


class NormTimer:
    """Wall time inside the norm modules: forward (pre-hook to hook) and backward (backward
    pre-hook to backward hook)."""

    def __init__(self, model):
        self.total = 0.0
        self.handles = []
        for m in norm_modules(model):
            self.handles += [
                m.register_forward_pre_hook(self._start),
                m.register_forward_hook(self._stop),
                m.register_full_backward_pre_hook(self._start),
                m.register_full_backward_hook(self._stop),
            ]

    def _start(self, *_):
        self.t0 = time.perf_counter()

    def _stop(self, *_):
        self.total += time.perf_counter() - self.t0

    def remove(self):
        for h in self.handles:
            h.remove()


def step(model, opt, ids):
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss.item()


def measure(models, opts, ids, steps):
    times = {name: [] for name in models}
    for _ in range(steps):
        for name in models:
            t0 = time.perf_counter()
            step(models[name], opts[name], ids)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def norm_share(model, opt, ids, steps):
    timer = NormTimer(model)
    try:
        step(model, opt, ids)
        timer.total = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            step(model, opt, ids)
        elapsed = time.perf_counter() - t0
    finally:
        timer.remove()
    return timer.total / steps, elapsed / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    base = build(args)
    patched = copy.deepcopy(base)
    count = rt.patch(patched)
    models = {"unpatched": base, "patched": patched}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)

    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch "
        f"threads available, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"rmsnorm ISA {rmsnorm.isa()}"
    )
    print(
        f"# Llama hidden {args.hidden}, layers {args.layers}, vocab {args.vocab}, batch "
        f"{args.batch} x seq {args.seq}, {args.dtype}, AdamW; {count} RMSNorm modules patched"
    )
    header = (
        f"{'threads':>7s} {'model':>10s} {'step ms':>9s} {'norm ms':>8s} {'norm share':>10s} "
        f"{'hooked step ms':>14s} {'speed-up':>8s}"
    )
    print(header)
    for threads in args.threads:
        torch.set_num_threads(threads)
        rmsnorm.set_num_threads(threads)
        measure(models, opts, ids, args.warmup)
        medians = measure(models, opts, ids, args.steps)
        for name in models:
            norm_s, hooked_s = norm_share(models[name], opts[name], ids, max(2, args.steps // 2))
            speedup = medians["unpatched"] / medians[name]
            print(
                f"{threads:7d} {name:>10s} {medians[name] * 1e3:9.1f} {norm_s * 1e3:8.2f} "
                f"{norm_s / hooked_s:10.1%} {hooked_s * 1e3:14.1f} {speedup:8.3f}"
            )


if __name__ == "__main__":
    main()
