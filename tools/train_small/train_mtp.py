#!/usr/bin/env python3
"""Train the MTP head of lily's default model (docs/model.md §7) with the main model frozen, on the CPU.

The head drafts token p+2 from the main model's final-normed hidden state at p and the embedding of token p+1.
The main model never changes, so its hidden states are computed once (`dump`) and the head alone is trained on
them (`train`), then quantized as lily quantizes the main layers and added to the bundled checkpoint (`export`),
and measured with lily.reference (`eval`). Stages, each resumable from the files of the one before:

  dump    the trunk's final-normed hidden states of --windows windows of --seq tokens of data/train.bin (seeded
          offsets) and of the first --val-windows windows of heldout/val.bin (training's validation), with lily's CPU engine (forward_trace: the residual
          after the last layer, then model.norm), or lily.reference when the extension is not built
          -> out/mtp/{train,val}_{hidden.f16,tokens.u16}.npy
  train   the head in PyTorch (CPU, fp32), the exact math of lily.reference.mtp_forward on rows (h_p, x_{p+1}) at
          position p of each window (its own causal attention over the window), the main embedding and lm_head
          frozen. Loss: cross-entropy on the true x_{p+2} mixed with the KL to the main model's own distribution
          for x_{p+2} (lm_head(h_{p+1}), free from the dump) by --distill; Switch load-balancing loss on the
          router. AdamW, warmup then cosine over --budget-s of wall time (or exactly --steps steps); the step with
          the best validation loss is kept. Initialised from the main model: the attention, MoE and norms of its
          last full-attention layer, mtp.norm = model.norm, fc = [0 | I] (the hidden half the identity), so it
          starts from the main model's own next-token prediction.  -> out/mtp/head.npz, out/mtp/train_log.json
  export  quantize the head by the main layers' rules (lily.testing.weights' contract format: 4-bit g64, router
          and shared-expert gate 8-bit) and write the bundled checkpoint again with lily.testing's
          write_mlx_checkpoint (the head as language_model.mtp.*, mtp_num_hidden_layers 1); every main tensor is
          checked byte for byte against the file before.
  eval    with lily.reference on heldout/val.bin: teacher-forced top-1 accuracy of the quantized head for x_{p+2},
          and greedy chain acceptance for k = 1..4 (mtp_draft_greedy against the main model's own greedy
          continuation)  -> runs/mtp_eval.json

`python3 train_mtp.py all` runs the four. Deterministic for a given --seed and --steps (torch on the CPU, one
process); with --budget-s alone the step count follows the machine's speed (the log records it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_MODEL = ROOT / "src" / "lily" / "models" / "default"
sys.path.insert(0, str(ROOT / "src"))


# ---- the frozen main model ------------------------------------------------------------------------------------------
def load_trunk(model_dir: Path):
    """(config, Weights, tensors, quant) of the main model, without any head (mtp=False)."""
    from lily.checkpoint import load_checkpoint
    from lily.reference import Weights
    ck = load_checkpoint(str(model_dir), progress=False)
    return ck.config, Weights(ck.tensors, ck.quant), ck.tensors, ck.quant


def _hidden_fn(model_dir: Path):
    """tokens [L] -> final-normed hidden [L, H] of the main model from position 0 (CPU engine, else reference)."""
    from lily.reference import ReferenceState, forward_hidden
    from lily.reference.ops import rms_norm
    cfg, w, _, _ = load_trunk(model_dir)
    try:
        import lily
        m = lily.load(str(model_dir), backend="cpu", mtp=False)
        last = f"moe.{cfg.num_hidden_layers - 1}"
        norm = w.vec("model.norm.weight")

        def run(tokens):
            tr = m.engine.forward_trace(m.engine.new_state(), tokens.astype(np.int64))
            return rms_norm(np.asarray(tr[last]), norm, cfg.rms_norm_eps)
        print("[dump] main model on lily's CPU engine")
    except Exception as e:  # the extension is not built: the NumPy reference (slow)
        print(f"[dump] CPU engine unavailable ({type(e).__name__}: {e}); using lily.reference")

        def run(tokens):
            return forward_hidden(w, cfg, ReferenceState(cfg), tokens.astype(np.int64))
    return run


def dump(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = _hidden_fn(Path(args.model))
    train = np.fromfile(Path(args.data) / "train.bin", dtype=np.uint16)
    val = np.fromfile(args.val, dtype=np.uint16)
    L = args.seq
    rng = np.random.default_rng(args.seed)
    starts = np.sort(rng.choice(len(train) // L, size=args.windows, replace=False)) * L
    sets = {"train": np.stack([train[s:s + L] for s in starts]),
            "val": np.stack([val[i * L:(i + 1) * L] for i in range(min(args.val_windows, len(val) // L))])}
    for name, toks in sets.items():
        if (out / f"{name}_hidden.f16.npy").is_file():
            print(f"[dump] {name}: done before")
            continue
        # parts of 32 windows saved as they complete, so an interrupted dump resumes where it stopped
        t0, parts = time.time(), []
        for a in range(0, len(toks), 32):
            part = out / f"{name}_part{a // 32:04d}.npy"
            if not part.is_file():
                hid = np.stack([run(t) for t in toks[a:a + 32]]).astype(np.float16)
                np.save(part, hid)
                print(f"[dump] {name} {min(a + 32, len(toks))}/{len(toks)} windows, {time.time() - t0:.0f} s",
                      flush=True)
            parts.append(part)
        np.save(out / f"{name}_hidden.f16.npy", np.concatenate([np.load(p) for p in parts]))
        np.save(out / f"{name}_tokens.u16.npy", toks)
        for p in parts:
            p.unlink()
        print(f"[dump] {name}: {toks.size:,} tokens in {time.time() - t0:.0f} s")


# ---- the head in PyTorch (lily.reference.mtp_forward's math) --------------------------------------------------------
def _last_attention_layer(cfg) -> int:
    return max(i for i in range(cfg.num_hidden_layers) if cfg.is_attention(i))


def init_head(cfg, w) -> dict[str, np.ndarray]:
    """Dense float32 head (contract names, MLX convention: norms stored 1 + γ) from the main model: its last
    full-attention layer's attention, MoE and norms, mtp.norm = model.norm, the two pre-fc norms 1, fc = [0 | I]."""
    from lily.mtp_source import MTP_LAYER_PREFIX, expected_mtp_modules
    lin, vec = expected_mtp_modules(cfg)
    src = f"model.layers.{_last_attention_layer(cfg)}"
    H = cfg.hidden_size
    head: dict[str, np.ndarray] = {}
    for module in lin:
        if module.startswith(MTP_LAYER_PREFIX):
            head[module + ".weight"] = np.asarray(w.linear(src + module[len(MTP_LAYER_PREFIX):]), np.float32)
    for name in vec:
        if name.startswith(MTP_LAYER_PREFIX):
            head[name] = np.asarray(w.vec(src + name[len(MTP_LAYER_PREFIX):]), np.float32)
    head["mtp.fc.weight"] = np.concatenate([np.zeros((H, H), np.float32), np.eye(H, dtype=np.float32)], axis=1)
    head["mtp.pre_fc_norm_embedding.weight"] = np.ones(H, np.float32)
    head["mtp.pre_fc_norm_hidden.weight"] = np.ones(H, np.float32)
    head["mtp.norm.weight"] = np.asarray(w.vec("model.norm.weight"), np.float32).copy()
    assert set(head) == {m + ".weight" for m in lin} | set(vec), "init_head does not cover the head's tensors"
    return head


class TorchHead:
    """The MTP head's forward on batches of whole windows: rows (h_p, x_{p+1}) at positions p = 0..L-1, causal
    attention over the window (the head's KV cache of a prefill). Frozen: embedding [V, H], lm_head [V, H]."""

    def __init__(self, cfg, params: dict[str, np.ndarray], embed: np.ndarray, lm_head: np.ndarray):
        import torch
        self.torch, self.cfg = torch, cfg
        self.p = {k: torch.nn.Parameter(torch.from_numpy(np.array(v, np.float32))) for k, v in params.items()}
        self.embed = torch.from_numpy(np.asarray(embed, np.float32))
        self.lm_head = torch.from_numpy(np.asarray(lm_head, np.float32))
        D, R = cfg.head_dim, cfg.rotary_dim
        inv = cfg.rope_theta ** (-np.arange(R // 2, dtype=np.float64) * 2.0 / R)
        self.inv_freq = inv
        self._rope_cache: dict[int, tuple] = {}

    def parameters(self):
        return list(self.p.values())

    def state(self) -> dict[str, np.ndarray]:
        return {k: v.detach().numpy().copy() for k, v in self.p.items()}

    def _rms(self, x, w):
        eps = self.cfg.rms_norm_eps
        return x * self.torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def _rope(self, x):  # x [B, L, h, D]: half-split (NeoX) on the first rotary_dim dims, positions 0..L-1
        torch = self.torch
        L, R = x.shape[1], self.cfg.rotary_dim
        if L not in self._rope_cache:
            ang = np.arange(L, dtype=np.float64)[:, None] * self.inv_freq[None, :]
            self._rope_cache[L] = (torch.from_numpy(np.cos(ang).astype(np.float32))[None, :, None, :],
                                   torch.from_numpy(np.sin(ang).astype(np.float32))[None, :, None, :])
        cos, sin = self._rope_cache[L]
        half = R // 2
        x1, x2, rest = x[..., :half], x[..., half:R], x[..., R:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    def _attention(self, h):
        torch, cfg, p = self.torch, self.cfg, self.p
        a = "mtp.layers.0.self_attn."
        B, L, _ = h.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = (h @ p[a + "q_proj.weight"].T).view(B, L, Hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(B, L, Hq * D)  # per head [query | gate]
        k = (h @ p[a + "k_proj.weight"].T).view(B, L, Hkv, D)
        v = (h @ p[a + "v_proj.weight"].T).view(B, L, Hkv, D)
        q = self._rope(self._rms(q, p[a + "q_norm.weight"]))
        k = self._rope(self._rms(k, p[a + "k_norm.weight"]))
        g = Hq // Hkv
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # query head j reads KV head j // g
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        o = o.transpose(1, 2).reshape(B, L, Hq * D) * torch.sigmoid(gate)
        return o @ p[a + "o_proj.weight"].T

    def _moe(self, h):
        """Sparse MoE with the shared expert; returns (out, Switch load-balancing loss)."""
        torch, cfg, p = self.torch, self.cfg, self.p
        m = "mtp.layers.0.mlp."
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        N, E, K = x.shape[0], cfg.num_experts, cfg.num_experts_per_tok
        probs = torch.softmax(x @ p[m + "gate.weight"].T, dim=-1)
        wts, idx = probs.topk(K, dim=-1)
        if cfg.norm_topk_prob:
            wts = wts / wts.sum(-1, keepdim=True)
        flat_e = idx.reshape(-1)
        flat_t = torch.arange(N).repeat_interleave(K)
        flat_w = wts.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=E).tolist()
        Wg, Wu, Wd = (p[m + f"switch_mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        out = torch.zeros_like(x)
        start = 0
        for e, c in enumerate(counts):
            if c:
                sel = order[start:start + c]
                t = flat_t[sel]
                xe = x[t]
                y = (torch.nn.functional.silu(xe @ Wg[e].T) * (xe @ Wu[e].T)) @ Wd[e].T
                out = out.index_add(0, t, y * flat_w[sel, None])
            start += c
        s = "shared_expert."
        sh = torch.nn.functional.silu(x @ p[m + s + "gate_proj.weight"].T) * (x @ p[m + s + "up_proj.weight"].T)
        out = out + torch.sigmoid(x @ p[m + "shared_expert_gate.weight"].T) * (sh @ p[m + s + "down_proj.weight"].T)
        frac = torch.bincount(flat_e, minlength=E).float() / (N * K)
        aux = E * (frac * probs.mean(0)).sum()
        return out.view(shape), aux

    def forward(self, hidden, next_tokens):
        """hidden [B, L, H] (final-normed), next_tokens int [B, L] -> (out [B, L, H] after mtp.norm, aux loss)."""
        torch, p = self.torch, self.p
        e = self._rms(self.embed[next_tokens], p["mtp.pre_fc_norm_embedding.weight"])
        hn = self._rms(hidden, p["mtp.pre_fc_norm_hidden.weight"])
        x = torch.cat([e, hn], dim=-1) @ p["mtp.fc.weight"].T  # embedding FIRST
        x = x + self._attention(self._rms(x, p["mtp.layers.0.input_layernorm.weight"]))
        moe, aux = self._moe(self._rms(x, p["mtp.layers.0.post_attention_layernorm.weight"]))
        return self._rms(x + moe, p["mtp.norm.weight"]), aux

    def losses(self, hid, tok, distill: float):
        """hid [B, L, H] float32, tok int [B, L] of windows -> (loss, ce, kl, aux, top1 correct, count), on rows
        p = 0..L-3: (h_p, x_{p+1}) -> x_{p+2}; the teacher is the main model's lm_head(h_{p+1})."""
        torch = self.torch
        F = torch.nn.functional
        out, aux = self.forward(hid[:, :-2], tok[:, 1:-1])
        logits = out @ self.lm_head.T
        target = tok[:, 2:]
        logp = F.log_softmax(logits, -1)
        ce = F.nll_loss(logp.reshape(-1, logp.shape[-1]), target.reshape(-1))
        with torch.no_grad():
            teacher = F.log_softmax(hid[:, 1:-1] @ self.lm_head.T, -1)
        kl = (teacher.exp() * (teacher - logp)).sum(-1).mean()
        loss = (1 - distill) * ce + distill * kl
        correct = (logits.argmax(-1) == target).sum().item()
        return loss, ce, kl, aux, correct, target.numel()


def _load_dump(out: Path, name: str):
    hid = np.load(out / f"{name}_hidden.f16.npy", mmap_mode="r")
    tok = np.load(out / f"{name}_tokens.u16.npy")
    return hid, tok


def train(args) -> None:
    import torch
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    cfg, w, _, _ = load_trunk(Path(args.model))
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = w.embed_rows(np.arange(V))
    head = TorchHead(cfg, init_head(cfg, w), embed, w.linear("lm_head"))
    hid_tr, tok_tr = _load_dump(out, "train")
    hid_va, tok_va = _load_dump(out, "val")
    n_val = min(args.val_windows, len(tok_va))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    rng = np.random.default_rng(args.seed)
    L = args.seq

    def batch(hid, tok, rows):
        # windows of the dump cropped to L tokens (a random crop when shorter than the dump's windows)
        s = 0 if L >= tok.shape[1] else int(rng.integers(0, tok.shape[1] - L + 1))
        return (torch.from_numpy(np.asarray(hid[rows, s:s + L], np.float32)),
                torch.from_numpy(tok[rows, s:s + L].astype(np.int64)))

    def validate():
        tot = dict(loss=0.0, ce=0.0, kl=0.0, correct=0, count=0)
        with torch.no_grad():
            for i in range(0, n_val, args.batch):
                rows = np.arange(i, min(i + args.batch, n_val))
                h = torch.from_numpy(np.asarray(hid_va[rows], np.float32))
                t = torch.from_numpy(tok_va[rows].astype(np.int64))
                loss, ce, kl, _, c, n = head.losses(h, t, args.distill)
                for k, v in (("loss", loss.item() * n), ("ce", ce.item() * n), ("kl", kl.item() * n),
                             ("correct", c), ("count", n)):
                    tot[k] += v
        n = tot.pop("count")
        return {k: (v / n) for k, v in tot.items()} | {"top1": tot["correct"] / n}

    def lr_at(step, total):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    v0 = validate()
    print(f"[train] init: val {json.dumps({k: round(v, 4) for k, v in v0.items()})}", flush=True)
    log = {"args": vars(args), "init_val": v0, "steps": [], "val": []}
    best = (v0["loss"], 0, head.state())
    t0 = time.time()
    total = args.steps or 10**9
    step = 0
    stop_file = out / "STOP"  # touch it to end training now, keeping the best step so far
    stop_file.unlink(missing_ok=True)
    order = rng.permutation(len(tok_tr))
    pos = 0
    while step < total:
        if pos + args.batch > len(order):
            order, pos = rng.permutation(len(tok_tr)), 0
        rows = np.sort(order[pos:pos + args.batch])
        pos += args.batch
        h, t = batch(hid_tr, tok_tr, rows)
        lr = lr_at(step, total)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, ce, kl, aux, c, n = head.losses(h, t, args.distill)
        opt.zero_grad()
        (loss + args.aux * aux).backward()
        gn = torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0).item()
        opt.step()
        step += 1
        el = time.time() - t0
        log["steps"].append({"step": step, "loss": loss.item(), "ce": ce.item(), "kl": kl.item(), "aux": aux.item(),
                             "top1": c / n, "lr": lr, "grad_norm": gn, "time_s": el})
        if step == 5:
            t5 = el  # the first steps are slow (allocation, page faults): the speed is measured after them
        if not args.steps and step == args.calibrate:
            # fix the schedule from the speed of steps 5..calibrate so that training fills the budget
            rate = (el - t5) / (step - 5)
            total = max(step + 1, step + int((args.budget_s - el) / rate))
            print(f"[train] {rate:.2f} s/step -> {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            print(f"[train] step {step}/{total if total < 10**9 else '?'} loss {loss.item():.4f} ce {ce.item():.4f} "
                  f"kl {kl.item():.4f} aux {aux.item():.3f} top1 {c / n:.3f} lr {lr:.2e} {el:.0f} s", flush=True)
        if step % args.val_every == 0 or step == total:
            v = validate() | {"step": step, "time_s": time.time() - t0}
            log["val"].append(v)
            print(f"[train] step {step} val loss {v['loss']:.4f} ce {v['ce']:.4f} kl {v['kl']:.4f} "
                  f"top1 {v['top1']:.4f}", flush=True)
            if v["loss"] < best[0]:
                best = (v["loss"], step, head.state())
        if (args.hard_stop_s and time.time() - t0 > args.hard_stop_s) or stop_file.exists() or \
                step == args.stop_step:
            print(f"[train] hard stop at step {step}", flush=True)
            if not log["val"] or log["val"][-1]["step"] != step:
                v = validate() | {"step": step, "time_s": time.time() - t0}
                log["val"].append(v)
                if v["loss"] < best[0]:
                    best = (v["loss"], step, head.state())
            break
    log["train_time_s"] = time.time() - t0
    log["total_steps"] = step
    log["best_step"] = best[1]
    log["tokens_seen"] = step * args.batch * (min(L, tok_tr.shape[1]) - 2)
    np.savez(out / "head.npz", **best[2])
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"[train] {step} steps in {log['train_time_s']:.0f} s; kept step {best[1]} (val loss {best[0]:.4f}) "
          f"-> {out / 'head.npz'}")


# ---- export ---------------------------------------------------------------------------------------------------------
def quantize_head(cfg, dense: dict[str, np.ndarray]):
    """Dense float32 head -> (tensors, quant) in the contract format, by the main layers' rules: rounded to bf16 (as
    an HF original stores it), then lily.testing.weights' own path (4-bit g64, router and shared-expert gate 8-bit,
    the mx.quantize-identical lily.quant.quantize)."""
    from lily.mtp_source import expected_mtp_modules
    from lily.quant import round_bf16
    from lily.testing.weights import _contract_format
    bf = {k: round_bf16(np.asarray(v, np.float32)) for k, v in dense.items()}
    return _contract_format(bf, expected_mtp_modules(cfg)[0], quantized=True)


def raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a safetensors file as (dtype tag, shape, its bytes), read from the header, no library."""
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {k: (t["dtype"], t["shape"], data[t["data_offsets"][0]:t["data_offsets"][1]])
            for k, t in header.items() if k != "__metadata__"}


def trunk_digest(path: Path) -> str:
    """sha256 of every non-MTP tensor's name, dtype tag, shape and bytes, by name (tests/test_bundled_mtp.py)."""
    import hashlib
    h = hashlib.sha256()
    for name, (tag, shape, b) in sorted(raw_tensors(path).items()):
        if ".mtp." not in "." + name:
            h.update(f"{name}|{tag}|{shape}|".encode())
            h.update(b)
    return h.hexdigest()


def export(args) -> None:
    import shutil
    from lily.checkpoint import load_checkpoint
    from lily.testing.checkpoint_writer import with_mtp_layers, write_mlx_checkpoint
    model_dir, out = Path(args.model), Path(args.out)
    ck = load_checkpoint(str(model_dir), progress=False)  # the main tensors only (the loader keeps mtp.* apart)
    head_t, head_q = quantize_head(ck.config, dict(np.load(out / "head.npz")))
    stage = out / "export"
    shutil.rmtree(stage, ignore_errors=True)
    write_mlx_checkpoint(stage, with_mtp_layers(ck.raw_config, 1), {**ck.tensors, **head_t}, {**ck.quant, **head_q})
    old, new = raw_tensors(model_dir / "model.safetensors"), raw_tensors(stage / "model.safetensors")
    trunk = [k for k in new if ".mtp." not in "." + k]
    bad = sorted(set(old) ^ set(trunk)) + [k for k in old if k in new and old[k] != new[k]]
    if bad:
        raise SystemExit(f"[export] main tensors differ from {model_dir}: {bad[:8]} ({len(bad)} in all); nothing "
                         f"written")
    heads = sorted(set(new) - set(old))
    print(f"[export] {len(old)} main tensors byte-identical (trunk digest {trunk_digest(stage / 'model.safetensors')})"
          f"; {len(heads)} head tensors, {sum(len(new[k][2]) for k in heads):,} bytes")
    old_cfg, new_cfg = (json.loads((d / "config.json").read_text()) for d in (model_dir, stage))
    for key in ("quantization", "quantization_config"):
        extra = {k: v for k, v in new_cfg[key].items() if k not in old_cfg[key]}
        if {k: v for k, v in new_cfg[key].items() if k in old_cfg[key]} != old_cfg[key] or \
                not all(k.startswith("language_model.mtp.") for k in extra):
            raise SystemExit(f"[export] the {key} block changed beyond the head's entries; nothing written")
    for name in ("model.safetensors", "model.safetensors.index.json", "config.json"):
        shutil.copy2(stage / name, model_dir / name)
    print(f"[export] wrote {model_dir}: model.safetensors, model.safetensors.index.json, config.json "
          f"(mtp_num_hidden_layers 1)")


# ---- evaluation with lily.reference ---------------------------------------------------------------------------------
def _head_weights(model_dir: Path):
    from lily.mtp_source import load_with_mtp
    from lily.reference import Weights
    ck = load_with_mtp(str(model_dir), mtp=True, progress=False)
    return ck.config, Weights(ck.tensors, ck.quant), Weights(ck.mtp.tensors, ck.mtp.quant)


def teacher_forced_top1(cfg, w, m, tokens: np.ndarray, window: int, hidden_fn=None, chunk: int = 256
                        ) -> tuple[int, int]:
    """(correct, count) of the head's argmax for x_{p+2} from the main model's hidden at p and the true x_{p+1},
    over consecutive windows of tokens (each from position 0), every row p = 0..len-3 of each window scored. The
    head runs in lily.reference (mtp_forward, its KV cache filled chunk by chunk); the main model's hidden states
    come from hidden_fn(tokens) -> [L, H] when given (the CPU engine: the same rows as lily.reference's to 5e-6,
    ~10x faster), else from lily.reference's forward_hidden."""
    from lily.reference import MtpState, ReferenceState, forward_hidden, mtp_forward
    correct = count = 0
    for s in range(0, len(tokens) - 2, window):
        t = tokens[s:s + window].astype(np.int64)
        if len(t) < 3:
            break
        ms, rs = MtpState(cfg), ReferenceState(cfg)
        whole = hidden_fn(t[:-2]) if hidden_fn is not None else None
        for a in range(0, len(t) - 2, chunk):
            b = min(a + chunk, len(t) - 2)
            h = whole[a:b] if whole is not None else forward_hidden(w, cfg, rs, t[a:b])
            logits, _ = mtp_forward(w, m, cfg, ms, h, t[a + 1:b + 1])
            correct += int((logits.argmax(-1) == t[a + 2:b + 2]).sum())
            count += b - a
    return correct, count


def greedy_acceptance(cfg, w, m, prompt: np.ndarray, n_new: int, kmax: int) -> list[list[int]]:
    """The main model continues prompt greedily by n_new tokens (lily.reference); at each position j whose next
    token x_{j+1} is the main model's, the head (its cache filled with the rows (h_p, x_{p+1}), p < j) drafts kmax
    chained greedy tokens from (h_j, x_{j+1}); returns, per position, the number of leading drafts equal to the
    main model's own greedy x_{j+2}.. (capped at kmax; the acceptance for k < kmax is min(k, that))."""
    from lily.reference import MtpState, ReferenceState, forward_hidden, mtp_draft_greedy, mtp_forward
    lm = w.linear("lm_head")
    rs = ReferenceState(cfg)
    seq = [int(x) for x in prompt]
    hid = [forward_hidden(w, cfg, rs, np.asarray(seq, np.int64))]
    for _ in range(n_new):
        seq.append(int(np.argmax(hid[-1][-1] @ lm.T)))
        hid.append(forward_hidden(w, cfg, rs, np.asarray(seq[-1:], np.int64)))
    h = np.concatenate(hid)  # [len(seq), H]
    n0 = len(prompt)
    ms = MtpState(cfg)
    mtp_forward(w, m, cfg, ms, h[:n0 - 1], np.asarray(seq[1:n0], np.int64))  # rows p = 0..n0-2
    full = ms.snapshot()
    accepted = []
    for j in range(n0 - 1, len(seq) - kmax - 1):
        # row j pairs h_j with x_{j+1}, the main model's greedy token; the cache holds rows 0..j-1
        ms.restore(full)
        if j > ms.position:
            mtp_forward(w, m, cfg, ms, h[ms.position:j], np.asarray(seq[ms.position + 1:j + 1], np.int64))
            full = ms.snapshot()
        ms.truncate(j)
        drafts = mtp_draft_greedy(w, m, cfg, ms, h[j], seq[j + 1], kmax)
        n = 0
        while n < kmax and drafts[n] == seq[j + 2 + n]:
            n += 1
        accepted.append(n)
    return accepted


def evaluate(args) -> None:
    model_dir = Path(args.model)
    cfg, w, m = _head_weights(model_dir)
    val = np.fromfile(args.val, dtype=np.uint16)
    t0 = time.time()
    n_tf = min(len(val), args.eval_tokens)
    hidden_fn = None if args.eval_trunk == "reference" else _hidden_fn(model_dir)
    c, n = teacher_forced_top1(cfg, w, m, val[:n_tf], args.seq, hidden_fn)
    t_tf = time.time() - t0
    print(f"[eval] teacher-forced top-1 {c}/{n} = {c / n:.4f} ({t_tf:.0f} s)", flush=True)
    rng = np.random.default_rng(args.seed)
    starts = np.sort(rng.choice((len(val) - args.prompt_len - args.new_tokens) // 64, args.prompts,
                                replace=False)) * 64
    per_prompt, t1 = [], time.time()
    for s in starts:
        acc = greedy_acceptance(cfg, w, m, val[s:s + args.prompt_len], args.new_tokens, args.kmax)
        per_prompt.append({"offset": int(s), "accepted": acc})
        print(f"[eval] prompt at {s}: {len(acc)} positions, mean accepted (k={args.kmax}) {np.mean(acc):.3f}",
              flush=True)
    allacc = np.concatenate([p["accepted"] for p in per_prompt])
    by_k = {str(k): float(np.minimum(allacc, k).mean()) for k in range(1, args.kmax + 1)}
    result = {
        "model": "lily-pydoc-25m + MTP head (this folder's train_mtp.py)",
        "engine": "lily.reference (NumPy, fp32) on the bundled checkpoint, the head as loaded (4-bit / 8-bit)",
        "data": "tools/train_small/heldout/val.bin",
        "teacher_forced": {"what": "argmax of the head for x_{p+2} from the main model's final-normed hidden at p "
                                   "and the true x_{p+1}; windows of %d tokens from position 0" % args.seq,
                           "main_model_hidden": "lily.reference" if hidden_fn is None else
                           "lily's CPU engine (forward_trace; equal to lily.reference's to 5e-6); the head in "
                           "lily.reference",
                           "tokens": int(n_tf), "positions": n, "correct": c, "top1": c / n,
                           "seconds": round(t_tf, 1)},
        "greedy_acceptance": {
            "what": "expected accepted length when the head drafts k chained greedy tokens (mtp_draft_greedy) "
                    "against the main model's own greedy continuation (the number of leading drafts it would "
                    "also choose, 0..k)",
            "prompts": len(starts), "prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens,
            "positions": int(allacc.size), "expected_accepted_by_k": by_k,
            "first_draft_acceptance": float((allacc >= 1).mean()),
            "per_prompt": per_prompt, "seconds": round(time.time() - t1, 1)},
    }
    log_path = Path(args.out) / "train_log.json"
    if log_path.is_file():
        log = json.loads(log_path.read_text())
        result["training"] = {k: log[k] for k in ("train_time_s", "total_steps", "best_step", "tokens_seen")} | {
            "init_val": log["init_val"], "best_val": min(log["val"], key=lambda v: v["loss"]) if log["val"] else None,
            "args": {k: log["args"][k] for k in ("seed", "lr", "batch", "seq", "distill", "aux", "budget_s", "steps")}}
    Path(args.eval_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.eval_out).write_text(json.dumps(result, indent=1))
    print(f"[eval] acceptance by k: {by_k}; -> {args.eval_out}")


# ---- command line ---------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["dump", "train", "export", "eval", "all"])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="the bundled checkpoint (read; export rewrites it)")
    ap.add_argument("--data", default=str(HERE / "data"), help="folder with train.bin (train_tokenizer.py)")
    ap.add_argument("--val", default=str(HERE / "heldout" / "val.bin"))
    ap.add_argument("--out", default=str(HERE / "out" / "mtp"), help="dumps, head.npz, train_log.json")
    ap.add_argument("--eval-out", default=str(HERE / "runs" / "mtp_eval.json"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    g = ap.add_argument_group("dump")
    g.add_argument("--windows", type=int, default=256, help="training windows of --seq tokens")
    g.add_argument("--seq", type=int, default=1024, help="window length (the main model's training length)")
    g = ap.add_argument_group("train")
    g.add_argument("--budget-s", type=float, default=1800, help="training wall time; sets the step count from the "
                                                                "speed of the first --calibrate steps")
    g.add_argument("--steps", type=int, default=0, help="exact step count (reproduces a run; overrides --budget-s)")
    g.add_argument("--hard-stop-s", type=float, default=0, help="stop whatever the schedule (0: never); "
                                                                    "so does creating OUT/STOP")
    g.add_argument("--stop-step", type=int, default=0, help="end after this step, inside --steps' schedule (the "
                                                             "shipped run: --steps 600 --stop-step 421)")
    g.add_argument("--calibrate", type=int, default=20, help="steps timed (from the 5th) to set the step count")
    g.add_argument("--batch", type=int, default=4, help="windows per step")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr-frac", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=20)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--distill", type=float, default=0.5, help="weight of the KL to the main model's distribution "
                                                              "(1 - it: cross-entropy on the true token)")
    g.add_argument("--aux", type=float, default=0.01, help="load-balancing loss coefficient")
    g.add_argument("--val-windows", type=int, default=16)
    g.add_argument("--val-every", type=int, default=50)
    g.add_argument("--log-every", type=int, default=10)
    g = ap.add_argument_group("eval")
    g.add_argument("--eval-tokens", type=int, default=10**9, help="teacher-forced positions from the start of val")
    g.add_argument("--eval-trunk", choices=["cpu", "reference"], default="cpu",
                   help="teacher-forced: the main model's hidden states from lily's CPU engine (falls back to the "
                        "reference without the extension) or lily.reference (~10x slower)")
    g.add_argument("--prompts", type=int, default=4)
    g.add_argument("--prompt-len", type=int, default=64)
    g.add_argument("--new-tokens", type=int, default=68)
    g.add_argument("--kmax", type=int, default=4)
    args = ap.parse_args(argv)
    for stage, fn in (("dump", dump), ("train", train), ("export", export), ("eval", evaluate)):
        if args.stage in (stage, "all"):
            fn(args)


if __name__ == "__main__":
    main()
