#!/usr/bin/env python3
"""Train lily's default model (model_config.py) with transformers' Qwen3_5MoeForCausalLM.

Runs on one GPU (bf16 autocast, fp32 master weights, AdamW, warmup + cosine) or, for a smoke test,
on the CPU with a tiny config (--tiny). Input: train.bin / val.bin from train_tokenizer.py
(uint16 ids). The step count is fixed after the first timed steps so that training fills
--budget-s seconds (pass --steps to reproduce a run exactly). The validation loss is measured every
--eval-every steps and the best weights are kept.

Output (--out): the best weights as an HF bf16 original (`model.language_model.*`, `lm_head.weight`,
fused `experts.gate_up_proj`, zero-centred norms, conv1d [C,1,K]) in shards of at most 15 MB with
model.safetensors.index.json and config.json (what lily.load converts like `mlx_lm.convert -q`),
plus train_log.json (loss curve, validation losses, wall time, routing histogram, samples).

MoE load balancing: the Switch-Transformer auxiliary loss per layer (E * sum_e f_e P_e, averaged
over the layers), from forward hooks on each router, so it does not depend on how a given
transformers version pools `router_logits`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import model_config as mc  # noqa: E402

TINY = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)


def log(*a):
    print(*a, flush=True)


# ---- experts: grouped GEMM in bf16 (same math as transformers' eager Qwen3_5MoeExperts) ----------------
def _grouped_mm(x, w, offs):
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x, w, offs=offs)
    return torch._grouped_mm(x, w, offs=offs)


def grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """hidden [T,H], top_k_index [T,K], top_k_weights [T,K] -> [T,H]. gate_up_proj [E,2I,H] (gate rows
    first), down_proj [E,H,I]."""
    T, H = hidden_states.shape
    K = top_k_index.shape[1]
    E = self.gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    dt = torch.bfloat16 if hidden_states.is_cuda else hidden_states.dtype
    x = hidden_states[tok].to(dt)
    gu = _grouped_mm(x, self.gate_up_proj.to(dt).transpose(1, 2), offs)
    gate, up = gu.chunk(2, dim=-1)
    h = F.silu(gate) * up
    y = _grouped_mm(h, self.down_proj.to(dt).transpose(1, 2), offs)
    y = y.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden_states.device).index_add_(0, tok, y)
    return out.to(hidden_states.dtype)


def install_grouped_experts(model, check: bool = True) -> bool:
    """Swap every Qwen3_5MoeExperts.forward for the grouped GEMM one after checking it against the eager
    forward (values and gradients) on random data; keep eager when anything fails."""
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    if not experts:
        return False
    m = experts[0]
    dev = m.gate_up_proj.device
    try:
        if check:
            torch.manual_seed(0)
            T, K, E = 300, model.config.num_experts_per_tok, model.config.num_experts
            x = torch.randn(T, model.config.hidden_size, device=dev)
            logits = torch.randn(T, E, device=dev)
            w, idx = torch.topk(logits.softmax(-1), K, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            outs = []
            for fwd in (type(m).forward, grouped_experts_forward):
                xx = x.clone().requires_grad_(True)
                for p in m.parameters():
                    p.grad = None
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                    y = fwd(m, xx, idx, w)
                y.float().square().sum().backward()
                outs.append((y.detach().float(), xx.grad.float(), m.gate_up_proj.grad.float().clone()))
            for a, b in zip(*outs):
                err = ((a - b).norm() / a.norm().clamp_min(1e-12)).item()
                if not err < 3e-2:
                    raise RuntimeError(f"grouped experts disagree with eager: rel err {err:.3g}")
            for p in m.parameters():
                p.grad = None
        for e in experts:
            e.forward = types.MethodType(grouped_experts_forward, e)
        return True
    except Exception as ex:  # noqa: BLE001
        log(f"grouped experts unavailable ({type(ex).__name__}: {ex}); using eager experts")
        return False


# ---- router statistics and the load-balancing loss -----------------------------------------------------
class RouterTap:
    def __init__(self, model):
        self.logits: list[torch.Tensor] = []
        self.handles = []
        self.k = model.config.num_experts_per_tok
        self.E = model.config.num_experts
        for name, mod in model.named_modules():
            if name.endswith(".mlp.gate"):
                self.handles.append(mod.register_forward_hook(self._hook))
        assert self.handles, "no routers found"

    def _hook(self, mod, inp, out):
        self.logits.append(out[0] if isinstance(out, tuple) else out)

    def pop(self):
        lg, self.logits = self.logits, []
        return lg

    def aux_loss(self, logits_list):
        """Switch loss per layer, averaged: E * sum_e (fraction of top-k slots to e) * (mean prob of e)."""
        total = 0.0
        for lg in logits_list:
            p = lg.float().softmax(-1)
            idx = torch.topk(p, self.k, dim=-1).indices
            f = torch.zeros(self.E, device=p.device).scatter_add_(
                0, idx.reshape(-1), torch.ones(idx.numel(), device=p.device)) / idx.numel()
            total = total + self.E * (f * p.mean(0)).sum()
        return total / len(logits_list)


def routing_histogram(logits_list, k):
    """[layers][experts] fraction of top-k slots."""
    out = []
    for lg in logits_list:
        idx = torch.topk(lg.float(), k, dim=-1).indices.reshape(-1)
        c = torch.bincount(idx, minlength=lg.shape[-1]).float()
        out.append((c / c.sum()).tolist())
    return out


# ---- data ----------------------------------------------------------------------------------------------
def load_ids(path, device):
    a = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    return torch.from_numpy(a).to(device)


def get_batch(data, B, T, gen):
    ix = torch.randint(0, data.numel() - T - 1, (B,), device=data.device, generator=gen)
    w = data[ix[:, None] + torch.arange(T + 1, device=data.device)]
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def evaluate(model, val, T, B, dev, tap=None):
    """Mean next-token loss over non-overlapping windows of T+1 tokens (the last partial one dropped)."""
    model.eval()
    n = (val.numel() - 1) // T
    tot, cnt = 0.0, 0
    logits_all = []
    for s in range(0, n, B):
        rows = torch.arange(s, min(n, s + B), device=dev)
        w = val[rows[:, None] * T + torch.arange(T + 1, device=dev)]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(input_ids=w[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += w[:, 1:].numel()
        if tap is not None:
            lg = tap.pop()
            logits_all = lg if not logits_all else [torch.cat([a, b]) for a, b in zip(logits_all, lg)]
    model.train()
    return tot / cnt, logits_all


# ---- saving --------------------------------------------------------------------------------------------
def save_hf(state, cfg_dict, out, shard_mb=15):
    from safetensors.torch import save_file
    named = []
    for k, v in state.items():
        name = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        named.append((name, v.to(torch.bfloat16).contiguous()))
    shards, cur, size = [], [], 0
    for name, t in named:
        nb = t.numel() * 2
        if cur and size + nb > shard_mb * 1024 * 1024:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nb
    shards.append(cur)
    wmap = {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(dict(sh), os.path.join(out, fn), metadata={"format": "pt"})
        wmap.update({n: fn for n, _ in sh})
    total = sum(t.numel() * 2 for _, t in named)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, f, indent=1)
    full = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": cfg_dict, "eos_token_id": cfg_dict.get("eos_token_id")}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(full, f, indent=1)


@torch.no_grad()
def samples(model, dev, tok_path, prompts, n_new=80):
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
    except Exception as ex:  # noqa: BLE001
        return [f"(no tokenizer: {ex})"]
    model.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p).ids], device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            g = model.generate(ids, max_new_tokens=n_new, do_sample=False,
                               eos_token_id=[mc.IM_END_ID, mc.ENDOFTEXT_ID], pad_token_id=mc.ENDOFTEXT_ID)
        out.append(tok.decode(g[0].tolist(), skip_special_tokens=False))
    model.train()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    ap.add_argument("--tiny", action="store_true", help="tiny config, CPU smoke test")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--aux", type=float, default=0.01, help="load-balancing loss coefficient")
    ap.add_argument("--budget-s", type=float, default=420.0, help="training seconds (sets the step count)")
    ap.add_argument("--hard-stop-s", type=float, default=0.0, help="stop training after this many seconds")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (0: from --budget-s)")
    ap.add_argument("--time-steps", type=int, default=25, help="steps timed to size the run")
    ap.add_argument("--eval-every", type=int, default=0, help="0: about 12 evaluations per run")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    import transformers
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    log("transformers", transformers.__version__)
    overrides = TINY if args.tiny else None
    cfg = mc.hf_text_config(overrides)
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001
        pass
    model = Qwen3_5MoeForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"params {n_params:,}")
    grouped = install_grouped_experts(model)
    log("experts:", "grouped_mm bf16" if grouped else "eager")
    tap = RouterTap(model)

    train = load_ids(os.path.join(args.data, "train.bin"), dev)
    val = load_ids(os.path.join(args.data, "val.bin"), dev)
    if args.tiny:
        val = val[: 8 * args.seq + 1]
    log(f"train tokens {train.numel():,}  val tokens {val.numel():,}")
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or n.endswith(("A_log", "dt_bias")) or "norm" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")

    total_steps = args.steps or 10 ** 9
    eval_every = args.eval_every or 10 ** 9

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    hist = {"step": [], "loss": [], "aux": [], "lr": [], "time": []}
    st = types.SimpleNamespace(evals=[], best=(float("inf"), -1, None), step=0, total_steps=args.steps or 10 ** 9,
                               eval_every=args.eval_every or 10 ** 9, t_train0=None, error=None)
    tokens_per_step = args.batch * args.seq

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(1.0, (step - args.warmup) / max(1, st.total_steps - args.warmup))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def do_eval():
        vl, _ = evaluate(model, val, args.seq, 16, dev)
        tap.pop()
        st.evals.append({"step": st.step, "val_loss": vl, "val_ppl": math.exp(vl),
                         "time": round(time.time() - t_start, 1)})
        log(f"  eval step {st.step}: val loss {vl:.4f} ppl {math.exp(vl):.2f}")
        if vl < st.best[0]:
            st.best = (vl, st.step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})

    model.train()
    try:
        while st.step < st.total_steps:
            step = st.step
            if step == 3:
                sync()
                st.t_train0 = time.time()
            if step == 3 + args.time_steps:
                if not args.steps:
                    sync()
                    dt = (time.time() - st.t_train0) / args.time_steps
                    st.total_steps = max(step + 10, int(args.budget_s / dt))
                    log(f"{dt * 1000:.1f} ms/step, {tokens_per_step / dt:,.0f} tok/s -> {st.total_steps} steps "
                        f"({st.total_steps * tokens_per_step / train.numel():.1f} epochs)")
                st.eval_every = args.eval_every or max(50, st.total_steps // 12)
                log(f"eval every {st.eval_every} steps")
            lr = lr_at(step)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = get_batch(train, args.batch, args.seq, gen)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = model(input_ids=x, use_cache=False).logits
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            aux = tap.aux_loss(tap.pop())
            loss = ce + args.aux * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            st.step = step = step + 1
            if step % 10 == 0 or step < 20:
                c, a = ce.item(), aux.item()
                if not math.isfinite(c):
                    raise FloatingPointError(f"loss is {c} at step {step}")
                elapsed = time.time() - t_start
                hist["step"].append(step); hist["loss"].append(c); hist["aux"].append(a)
                hist["lr"].append(lr); hist["time"].append(round(elapsed, 2))
                if step % 50 == 0 or step < 20:
                    log(f"step {step}/{st.total_steps if st.total_steps < 10 ** 9 else '?'} loss {c:.4f} "
                        f"aux {a:.4f} lr {lr:.2e} t {elapsed:.0f}s")
            stop = args.hard_stop_s and time.time() - t_start > args.hard_stop_s
            if step % st.eval_every == 0 or step >= st.total_steps or stop:
                do_eval()
            if stop:
                log(f"hard stop at step {step}")
                break
    except Exception as ex:  # noqa: BLE001  keep what was learned so far
        import traceback
        traceback.print_exc()
        st.error = f"{type(ex).__name__}: {ex}"
        if st.best[2] is None or (st.evals and st.evals[-1]["step"] != st.step):
            try:
                do_eval()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    if st.best[2] is None:
        sys.exit("no checkpoint to save")
    train_time = time.time() - (st.t_train0 or t_start)
    best_loss, best_step, best_state = st.best
    log(f"best val loss {best_loss:.4f} (ppl {math.exp(best_loss):.2f}) at step {best_step}; "
        f"train time {train_time:.0f}s")
    text_cfg = dict(mc.TEXT_CONFIG)
    if overrides:
        text_cfg.update(overrides)
        text_cfg["layer_types"] = list(cfg.layer_types)
    save_hf(best_state, text_cfg, args.out)
    log_d = {"args": vars(args), "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
             "torch": torch.__version__, "transformers": transformers.__version__,
             "experts_impl": "grouped_mm" if grouped else "eager", "params": n_params,
             "train_tokens": train.numel(), "val_tokens": val.numel(), "steps": st.step,
             "planned_steps": st.total_steps, "tokens_per_step": tokens_per_step,
             "train_time_s": round(train_time, 1), "best_step": best_step, "best_val_loss": best_loss,
             "best_val_ppl": math.exp(best_loss), "error": st.error, "evals": st.evals, "history": hist}

    def write_log():
        log_d["wall_time_s"] = round(time.time() - t_start, 1)
        with open(os.path.join(args.out, "train_log.json"), "w") as f:
            json.dump(log_d, f, indent=1)
    write_log()
    log(f"saved weights to {args.out}; wall {time.time() - t_start:.0f}s")
    try:
        model.load_state_dict(best_state)
        vl, lg = evaluate(model, val, args.seq, 16, dev, tap)
        log_d["val_routing"] = routing_histogram(lg, cfg.num_experts_per_tok)
        for i, h in enumerate(log_d["val_routing"]):
            log(f"  layer {i} routing: min {min(h):.4f} max {max(h):.4f} (uniform {1 / len(h):.4f})")
        write_log()
        for hnd in tap.handles:
            hnd.remove()
        log_d["samples"] = samples(model, dev, os.path.join(args.data, "tokenizer.json"),
                                   ["The list type", "def fibonacci(n):",
                                    "<|im_start|>user\nWhat is a dictionary?<|im_end|>\n<|im_start|>assistant\n<think>\n"],
                                   n_new=60 if args.tiny else 100)
        for smp in log_d["samples"]:
            log("---- sample\n" + smp)
        write_log()
    except Exception:  # noqa: BLE001
        import traceback
        traceback.print_exc()
    log(f"done; wall {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
