"""Full-size CUDA benchmark (Qwen3.6-35B-A3B shapes) with MLX-LM as a peer on the same checkpoint bytes.

For each length L: lily prefill of L tokens (fresh state, last-row logits, timed on the host: forward returns
the logits, so it is device-synchronised), then N decode steps from that state (3 untimed steps first; each
step is forward(1 token) + logits to the host + argmax fed back, as generation does); MLX-LM the same at its
lengths, alternating which engine goes first per length. Fractions of the limits use the ceilings measured in
the same run: decode bytes/token (weights + DeltaNet state read+written + KV at the context) x tok/s over the
copy bandwidth; prefill FLOPs/token (matrices + DeltaNet + causal attention at L/2) x tok/s over the bf16 rate.
Ablations (bench_cuda_ablate.py): each technique off alone via Engine.set_backend_flag, at the lengths where it
matters. Kernel launches per decode step and time by kernel family at 4K (CUPTI via torch.profiler).
A global budget (--budget-s) skips what is left, with rows marked "not measured (budget)".

Device (checkpoint from benchmarks/full_checkpoint.py; mlx-lm optional, via PYTHONPATH):
    PYTHONPATH=/tmp/site:src python3 benchmarks/bench_cuda.py --checkpoint /tmp/full35b --out $OUT
In-memory weights (no peer):  python3 benchmarks/bench_cuda.py --out $OUT
Dry run without a GPU (tiny checkpoint, CPU engine, mlx-lm on the CPU):
    PYTHONPATH=src python3 benchmarks/bench_cuda.py --backend cpu --config tiny --out /tmp/dry

Writes OUT/NAME.json ({hardware, git_sha, settings, rows: [{engine, phase, tokens, tok_s, ms, ...}], ablations,
kernel_profiles, counters, ...}), OUT/NAME.png and OUT/cuda_ablations_h200.md (dry run: cuda_ablations_dryrun.md).
`synthetic_weights` (the older constant-scale generator) stays for benchmarks/multiturn.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import sys
import tempfile

import numpy as np

from lily import _lily
from lily.bench import git_sha, hardware
from lily.testing.weights import GROUP, default_quant_bits, linear_modules

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda_ablate import ABLATIONS, Ablator, scaled, write_markdown  # noqa: E402
from bench_cuda_peer import MlxPeer  # noqa: E402
from bench_cuda_util import (CostModel, format_profile, kernel_profile, measure_ceilings, plot_sweep,  # noqa: E402
                             short_table, add_llamacpp)

BF16_ONE = 0x3F80


def bf16_bits(x: float) -> np.uint16:
    return np.uint16(np.float32(x).view(np.uint32) >> 16)


def synthetic_weights(cfg, seed=0):
    """Random codes sliced from one pool (views, no copies), scales giving each linear std ~ 1/sqrt(in)
    (0.1x on residual outputs, 2x on the router), zero-mean through the bias."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**32, size=1 << 27, dtype=np.uint32)  # 512 MB
    tensors, quant = {}, {}
    for mod, shape in linear_modules(cfg).items():
        bits = default_quant_bits(mod, shape)
        std = 1.0 / np.sqrt(shape[-1])
        if mod.endswith((".out_proj", ".o_proj", ".down_proj")):
            std *= 0.1
        if mod.endswith(".mlp.gate"):
            std *= 2.0
        if bits is None:
            tensors[mod + ".weight"] = np.full(shape, bf16_bits(std), np.uint16)
            continue
        words = int(np.prod(shape[:-1])) * shape[-1] * bits // 32
        off = int(rng.integers(0, pool.size - words))
        tensors[mod + ".weight"] = pool[off:off + words].reshape(*shape[:-1], shape[-1] * bits // 32)
        levels = (1 << bits) - 1
        scale = std / (levels / np.sqrt(12.0))
        gshape = (*shape[:-1], shape[-1] // GROUP)
        tensors[mod + ".scales"] = np.full(gshape, bf16_bits(scale), np.uint16)
        tensors[mod + ".biases"] = np.full(gshape, bf16_bits(-scale * levels / 2), np.uint16)
        quant[mod] = (bits, GROUP)
    H = cfg.hidden_size
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    tensors["model.norm.weight"] = ones(H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        tensors[p + ".input_layernorm.weight"] = ones(H)
        tensors[p + ".post_attention_layernorm.weight"] = ones(H)
        if cfg.is_attention(i):
            tensors[p + ".self_attn.q_norm.weight"] = ones(cfg.head_dim)
            tensors[p + ".self_attn.k_norm.weight"] = ones(cfg.head_dim)
        else:
            a = p + ".linear_attn"
            Hv = cfg.linear_num_value_heads
            tensors[a + ".conv1d.weight"] = (0.3 * rng.standard_normal((cfg.conv_dim, cfg.linear_conv_kernel_dim, 1))
                                             ).astype(np.float32)
            tensors[a + ".dt_bias"] = np.zeros(Hv, np.float32)
            tensors[a + ".A_log"] = np.log(rng.uniform(1, 16, Hv)).astype(np.float32)
            tensors[a + ".norm.weight"] = ones(cfg.linear_value_head_dim)
    return tensors, quant


LILY_LENGTHS = "256,512,1024,2048,4096,8192,16384,32768,65536,131072"
DRY_LENGTHS = {512: 48, 4096: 64, 16384: 96, 32768: 128, 131072: 128}  # ablation lengths in the dry run


def build_engine(args):
    """(engine, cfg, folder or None, load seconds): a checkpoint folder, or in-memory conditioned weights."""
    from lily.config import ModelConfig
    from lily.testing.fast_synthetic import conditioned_weights, write_fast_checkpoint
    from lily.testing.synthetic import config_dict
    folder = args.checkpoint or None
    if folder is None and args.backend != "cuda":  # dry run: a real folder so the mlx-lm path runs too
        folder = tempfile.mkdtemp(prefix=f"lily_bench_{args.config}_")
        write_fast_checkpoint(folder, config_dict(args.config), seed=0)
    t0 = time.perf_counter()
    if folder:
        from lily.checkpoint import load_checkpoint
        ck = load_checkpoint(folder, progress=False)
        cfg = ck.config if isinstance(ck.config, ModelConfig) else ModelConfig.from_dict(ck.config)
        tensors, quant = ck.tensors, ck.quant
    else:
        cfg = ModelConfig.from_dict(config_dict(args.config))
        tensors, quant = conditioned_weights(cfg)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=args.threads, max_context=args.max_context,
                       backend=args.backend)
    info = {"read_s": read_s, "engine_s": time.perf_counter() - t0}
    return (FlagStub(eng) if args.fake_flags else eng), cfg, folder, info


class FlagStub:
    """Dry run only: the engine with the ablation flags accepted and ignored, so the ablation code runs."""

    def __init__(self, eng):
        self._eng, self._flags = eng, {a.flag: a.meaning for a in ABLATIONS}
        self._vals = {"cuda_graph": 1, "routing_sync": 0, "gqa_pack": 1, "split_k": 1,
                      "deltanet_form": 0, "expert_tile": 0}

    def __getattr__(self, k):
        return getattr(self._eng, k)

    def backend_flag(self, name):
        return self._vals[name] if name in self._vals else self._eng.backend_flag(name)

    def set_backend_flag(self, name, value):
        if name not in self._vals:
            return self._eng.set_backend_flag(name, value)
        self._vals[name] = int(value)


# The server row's client (its own process): an untimed 4-token request through the openai client (the prompt's
# prefill; it also checks that client reads the stream), then timed requests of the same prompt with a short and a
# long max_tokens, twice each, sent pre-encoded over http.client; prints, per request, [seconds from sending it to its
# first chunk, to its last chunk, completion tokens]. The serve row's rate is the difference of the two lengths (the
# fastest of each): (long - short tokens) / (long - short seconds), the server's streaming rate with the request's
# own prefill and first step cancelled out. Why: a request of these random ids holds no <|im_start|>, so the prefix
# cache restores it from the last multiple of its 4,096-token snapshot interval and prefills the rest (up to 4,095
# tokens) on every request; "request to last chunk" over 33 tokens then read 156 tok/s at 2K and 377 at 4K
# (twelfth session: not the server's rate, the re-prefill). Chunks hold text, so a chunk may carry several tokens and
# most carry none: the synthetic checkpoint's tokenizer (write_tokenizer, trained on a small text) holds 727 of the
# model's 248,320 ids, and an id past it decodes to no text, so a random-weight model's stream sends a chunk for ~0.3%
# of its tokens and a request's first chunk often arrives with its last (first_chunk_s = request_s at 4K and above,
# thirteenth session): the counts come from the usage block. The openai client builds no timed request: its request building walks the prompt list in Python, ~14 us
# per prompt token (the tenth session's sweep timed it as the server's: 282 tok/s at 4K, 20 at 128K).
SERVE_CLIENT = r"""
import http.client, json, sys, time, urllib.parse
import openai
url, short, long_ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.stdin.read())  # stdin: a 128K-token prompt is over the command line limit
client = openai.OpenAI(base_url=url, api_key="-")
name = client.models.list().data[0].id
for ch in client.completions.create(model=name, prompt=prompt, max_tokens=4, temperature=0, stream=True):
    pass
u = urllib.parse.urlparse(url)


def timed(n):
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", u.path + "/completions", body, {"Content-Type": "application/json",
                                                          "Authorization": "Bearer -"})
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"HTTP {resp.status}: {resp.read()[:400]!r}")
    first = last = None
    tokens = 0
    for line in resp:  # server-sent events: "data: {chunk}" lines, then "data: [DONE]"
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line[6:] == b"[DONE]":
            break
        ch = json.loads(line[6:])
        if ch.get("usage"):
            tokens = ch["usage"]["completion_tokens"]
        if ch.get("choices"):
            last = time.perf_counter()
            first = last if first is None else first
    conn.close()
    if last is None:
        sys.exit("no chunk")
    return [first - t0, last - t0, tokens]


print(json.dumps([timed(n) for n in (short, long_, short, long_)]))
"""


class LilyRunner:
    """Prefill / decode timing on one engine; tokens are fixed random ids (teacher input, argmax fed back)."""

    def __init__(self, eng, toks, n_decode):
        self.eng, self.toks, self.n = eng, toks, n_decode
        self.name = f"lily-{eng.backend}"

    def prefill(self, L):
        st = self.eng.new_state()
        t0 = time.perf_counter()
        lg = self.eng.forward(st, self.toks[:L], logits="last")
        return st, time.perf_counter() - t0, int(np.argmax(lg[-1]))

    def decode(self, st, tok, n=None):
        """3 untimed steps then n timed steps (forward + logits to the host + argmax): seconds."""
        n = self.n if n is None else n
        for _ in range(3):
            tok = int(np.argmax(self.eng.forward(st, np.array([tok], np.int32), logits="last")[-1]))
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(self.eng.forward(st, np.array([tok], np.int32), logits="last")[-1]))
        return time.perf_counter() - t0

    def decode_sampled(self, st, tok, device):
        """Steps with temperature 0.7 / top-p 0.9 / top-k 50 sampling, as the session runs them: one token stream
        (Engine.open_stream) drawing on the device (run ahead one step) or lock-step (logits to the host +
        lily.sampling.Sampler)."""
        from lily.sampling import Sampler, SamplingParams
        p = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=0)
        opts = dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=0)

        def run(n, tok):
            s = self.eng.open_stream(st, tok, n, device=device, **opts)
            if device and not s.device:
                s.close()
                raise RuntimeError("the engine has no device sampler")
            if s.device:
                for _ in range(n):
                    tok = s.next()
            else:
                sampler = Sampler(p, self.eng.vocab_size)
                for _ in range(n):
                    tok = sampler.sample(s.step(tok))
            s.close()
            return tok

        tok = run(3, tok)
        t0 = time.perf_counter()
        run(self.n, tok)
        return time.perf_counter() - t0

    def generate_stream(self, model, L):
        """End to end: Model.session().generate(stream=True), greedy, after an untimed prefill of L tokens and an
        untimed 4-token generation; the decode seconds of its GenerationStats (first token to last) and the tokens
        after the first."""
        s = model.session()
        s.prefill([int(t) for t in self.toks[:L]])
        # untimed first: a new session's state records its own step graphs (one per parity: a capture and an
        # instantiation of ~260 nodes, once per state), which a 32-token timed run would otherwise carry; the
        # engine rows warm up the same way (3 untimed steps)
        for _ in s.generate(max_tokens=4, temperature=0.0, stream=True):
            pass
        n = 0
        for c in s.generate(max_tokens=self.n + 1, temperature=0.0, stream=True):
            n += 1
            stats = c.stats
        return stats.decode_s, n - 1

    def serve_stream(self, model, L):
        """The server end to end: `lily serve`'s app on this model (uvicorn in a thread of this process), the openai
        client in a process of its own (SERVE_CLIENT; in this one it would share the GIL with the server and the
        token loop), /v1/completions of the L prompt tokens (as ids), greedy, streamed; an untimed 4-token request
        first, then requests of a short and a long max_tokens (SERVE_CLIENT says why). Returns the seconds and
        tokens of the difference, and the long request's first-chunk and last-chunk seconds."""
        import json
        import socket
        import subprocess
        import threading

        import uvicorn
        from lily.server.app import create_app
        with socket.socket() as sk:  # a free port
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(model), host="127.0.0.1", port=port, log_level="warning"))
        th = threading.Thread(target=server.run, daemon=True)
        th.start()
        short, long_ = 9, max(4 * self.n, 64) + 1
        try:
            t_end = time.time() + 60
            while not server.started:
                if time.time() > t_end or not th.is_alive():
                    raise RuntimeError("the server did not start")
                time.sleep(0.02)
            r = subprocess.run([sys.executable, "-c", SERVE_CLIENT, f"http://127.0.0.1:{port}/v1", str(short),
                                str(long_)], input=json.dumps([int(t) for t in self.toks[:L]]), capture_output=True,
                               text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"client: {r.stderr[-400:]}")
            reqs = json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            server.should_exit = True
            th.join(10)
        s_req = min((q for q in reqs if q[2] == reqs[0][2]), key=lambda q: q[1])
        l_req = min((q for q in reqs if q[2] == reqs[1][2]), key=lambda q: q[1])
        if l_req[2] <= s_req[2]:
            raise RuntimeError(f"the long request streamed {l_req[2]} tokens, the short one {s_req[2]}")
        return l_req[1] - s_req[1], l_req[2] - s_req[2], {"first_chunk_s": l_req[0], "request_s": l_req[1],
                                                          "request_tokens": l_req[2]}

    def decode_greedy(self, st, tok):
        self.eng.decode_greedy(st, tok, 3)
        t0 = time.perf_counter()
        self.eng.decode_greedy(st, tok, self.n)
        return time.perf_counter() - t0


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="", help="checkpoint folder (benchmarks/full_checkpoint.py); "
                    "empty: weights generated in memory (no MLX-LM peer)")
    ap.add_argument("--config", default="full", help="in-memory / dry-run config: full or a tiny config name")
    ap.add_argument("--backend", default="cuda", help="cuda; cpu for the dry run")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="")
    ap.add_argument("--lengths", default="", help=f"lily lengths (default {LILY_LENGTHS}; dry run 32,64,96,128)")
    ap.add_argument("--mlx-lengths", default="", help="MLX-LM lengths (default 512,4096,16384; dry run 64,96)")
    ap.add_argument("--no-mlx", action="store_true")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--ablations", default="", help="only the ablations of these flags (comma-separated)")
    ap.add_argument("--fake-flags", action="store_true", help="dry run: accept and ignore the ablation flags")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--mlx-decode-steps", type=int, default=8)
    ap.add_argument("--profile-lengths", default="4096,131072",
                    help="lengths whose prefill and decode kernels are profiled by kernel name (torch's profiler)")
    ap.add_argument("--budget-s", type=float, default=480, help="wall-clock budget from the start of main")
    ap.add_argument("--replot", default="", help="only redraw the PNG and the ablation table from this JSON")
    ap.add_argument("--llamacpp-json", default="", help="the llama.cpp peer's results of the same H200 run "
                    "(../shared/peers/llamacpp/run_h200.sh: llamacpp_h200.json), added as rows of engine llama.cpp "
                    "(with --replot: added to that JSON, which is rewritten)")
    args = ap.parse_args(argv)
    dry = args.backend != "cuda"
    args.lengths = [int(x) for x in (args.lengths or ("32,64,96,128" if dry else LILY_LENGTHS)).split(",") if x]
    args.mlx_lengths = [] if args.no_mlx else [
        int(x) for x in (args.mlx_lengths or ("64,96" if dry else "512,4096,16384")).split(",") if x]
    args.profile_lengths = [int(x) for x in args.profile_lengths.split(",") if x]
    if dry and args.profile_lengths == [4096, 131072]:
        args.profile_lengths = [64]
    args.name = args.name or ("bench_cuda_h200" if not dry else "bench_cuda_dryrun")
    # room for the serve row's long request (serve_stream: 4 x decode steps + 1 completion tokens)
    args.max_context = max(args.lengths + args.mlx_lengths) + max(4 * args.decode_steps, 64) + 16
    return args


def main(argv=None):
    t_start = time.time()
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md_path = out / ("cuda_ablations_h200.md" if args.backend == "cuda" else "cuda_ablations_dryrun.md")
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        if args.llamacpp_json:
            from lily.config import ModelConfig
            from lily.testing.synthetic import config_dict
            hw = res["hardware"]
            cost = CostModel(ModelConfig.from_dict(config_dict(res["settings"]["config"])))
            add_llamacpp(res["rows"], res["settings"], args.llamacpp_json, cost, hw["copy_bandwidth_Bps"],
                         hw["bf16_matmul_flops"])
            Path(args.replot).write_text(json.dumps(res, indent=1, default=float))
            print(short_table(res["rows"]))
        plot_sweep(res["rows"], res["settings"].get("title", ""), Path(args.replot).with_suffix(".png"))
        write_markdown(res, md_path)
        return 0
    deadline = t_start + args.budget_s
    bw, mflops, dev_name = measure_ceilings(args.backend)
    print(f"ceilings ({dev_name}): copy {bw / 1e12:.3f} TB/s, matrix {mflops / 1e12:.1f} TFLOP/s", flush=True)
    eng, cfg, folder, load_info = build_engine(args)
    cost = CostModel(cfg)
    print(f"lily engine ({args.backend}) from {folder or 'memory'}: read {load_info['read_s']:.1f}s, engine "
          f"{load_info['engine_s']:.1f}s; weight bytes/token {cost.weight_bytes / 1e9:.3f} GB", flush=True)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, args.max_context).astype(np.int32)
    lily = LilyRunner(eng, toks, args.decode_steps)
    model = None  # lily.Model over the same engine, for the end-to-end rows (needs the checkpoint's tokenizer)
    if folder and (Path(folder) / "tokenizer.json").is_file() and args.backend == "cuda":
        from lily import Model
        from lily.tokenizer import Tokenizer
        model = Model(eng, Tokenizer(Path(folder) / "tokenizer.json"), cfg, path=folder)
    st, _, _ = lily.prefill(min(512, args.lengths[0]))  # warm-up: allocations, module load, graph capture
    lily.decode(st, 1, 2)
    del st
    peer = MlxPeer(folder) if args.mlx_lengths else None
    mlx_note = None
    if peer is not None:
        mlx_note = peer.error or peer.warm_up(toks)
        print(f"mlx-lm: {peer.info if peer.ok else mlx_note}", flush=True)
    ablations = ABLATIONS if args.backend == "cuda" else scaled(ABLATIONS, lambda x: DRY_LENGTHS.get(x, x))
    if args.ablations:
        keep = set(args.ablations.split(","))
        unknown = keep - {a.flag for a in ABLATIONS}
        if unknown:
            sys.exit(f"--ablations: unknown flag(s) {sorted(unknown)}; expected some of {sorted({a.flag for a in ABLATIONS})}")
        ablations = tuple(a for a in ablations if a.flag in keep)
    ablator = None if args.no_ablations else Ablator(eng, ablations, deadline)
    rows, profiles, checks = [], {}, {}

    def add(engine, phase, L, seconds=None, steps=None, note=None, **extra):
        r = {"engine": engine, "phase": phase, "tokens": L, "tok_s": None, "ms": None}
        if seconds:
            n = L if phase == "prefill" else steps
            r.update(tok_s=n / seconds, ms=1e3 * seconds / (1 if phase == "prefill" else steps))
            if phase == "prefill":
                r["frac_matrix_rate"] = cost.prefill_flops_per_token(L) * r["tok_s"] / mflops
            else:
                r["frac_bandwidth"] = cost.decode_bytes(L) * r["tok_s"] / bw
                r["bytes_per_token"] = cost.decode_bytes(L)
        if note:
            r["note"] = note
        r.update(extra)
        rows.append(r)
        if r["tok_s"]:
            print(f"{engine:16s} {phase:7s} L={L:6d} {r['tok_s']:10.1f} tok/s {r['ms']:9.3f} ms", flush=True)
        return r

    def run_lily(L):
        if time.time() > deadline:
            add(lily.name, "prefill", L, note="not measured (budget)")
            add(lily.name, "decode", L, note="not measured (budget)")
            return
        try:
            st, pf_s, tok = lily.prefill(L)
            if L <= 8192:  # short prompts: the first run at a new length also pays scratch growth; keep the best
                del st
                st, pf_s2, tok = lily.prefill(L)
                pf_s = min(pf_s, pf_s2)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at 128K: keep the other lengths
            add(lily.name, "prefill", L, note=f"error: {str(e)[:120]}")
            return
        pf = add(lily.name, "prefill", L, pf_s)
        snap = st.snapshot()
        dec = add(lily.name, "decode", L, lily.decode(st, tok), args.decode_steps)
        if args.backend == "cuda":
            try:
                st.restore(snap)
                add(lily.name + "-greedy", "decode", L, lily.decode_greedy(st, tok), args.decode_steps,
                    method="Engine.decode_greedy: argmax on the device, no logits copies")
            except Exception as e:  # noqa: BLE001
                checks[f"decode_greedy@{L}"] = repr(e)[:200]
            end_to_end = [
                ("generate", lily.generate_stream,
                 "Model.session().generate(stream=True), greedy: the Python API end to end (the engine's token "
                 "loop, detokenizing, stop checks), beside the raw step rate"),
                ("serve", lily.serve_stream,
                 "lily serve's app (uvicorn, in process) streaming /v1/completions to a client process, greedy: "
                 "the difference of a long and a short request of the same prompt (its prefill cancels out; "
                 "first_chunk_s and request_s are the long request's own, from sending it)")]
            for suffix, run, method in (end_to_end if model is not None else []):
                try:
                    sec, n, *extra = run(model, L)
                    add(f"{lily.name}-{suffix}", "decode", L, sec, n, method=method, **(extra[0] if extra else {}))
                except Exception as e:  # noqa: BLE001
                    checks[f"{run.__name__}@{L}"] = repr(e)[:200]
            for device in (False, True):
                try:
                    st.restore(snap)
                    add(lily.name + ("-sample-device" if device else "-sample-host"), "decode", L,
                        lily.decode_sampled(st, tok, device), args.decode_steps,
                        method="T 0.7, top-p 0.9, top-k 50: " + ("Engine.open_stream (drawn on the device)"
                                                                 if device else "lock-step stream + host Sampler"))
                except Exception as e:  # noqa: BLE001
                    checks[f"decode_sampled_device={device}@{L}"] = repr(e)[:200]
        if L in args.profile_lengths and time.time() < deadline:
            run_profiles(L, st, snap, tok)
        if ablator is not None:
            def measure_decode():
                st.restore(snap)
                return args.decode_steps / lily.decode(st, tok)

            def measure_prefill():
                lily.prefill(min(256, L))  # first use of the setting outside the timing
                return L / lily.prefill(L)[1]
            ablator.decode(L, dec["tok_s"], measure_decode)
            ablator.prefill(L, pf["tok_s"], measure_prefill)

    def run_profiles(L, st, snap, tok):
        try:
            import torch  # noqa: F401
        except ImportError:
            profiles["note"] = "torch not importable: no kernel profile"
            return
        if args.backend != "cuda":
            return
        for label, graph in (("graph", 1), ("nograph", 0)):
            try:
                eng.set_backend_flag("cuda_graph", graph)
                st.restore(snap)
                profiles[f"decode@{L} {label}"] = kernel_profile(
                    lambda i: eng.forward(st, np.array([toks[i]], np.int32), logits="last"), 8)
            except Exception as e:  # noqa: BLE001 - a report extra, never a reason to lose the figures
                profiles[f"decode@{L} {label}"] = {"error": repr(e)[:200]}
            finally:
                eng.set_backend_flag("cuda_graph", 1)
        try:
            profiles[f"prefill@{L}"] = kernel_profile(lambda i: eng.forward(eng.new_state(), toks[:L], logits="last"), 1)
        except Exception as e:  # noqa: BLE001
            profiles[f"prefill@{L}"] = {"error": repr(e)[:200]}
        counters = eng.backend_counters()
        checks.update({c: counters[c] for c in ("graph_nodes", "graph_kernels", "graph_captures", "decode_launches")
                       if c in counters})

    def run_mlx(L):
        if L not in args.mlx_lengths:
            return
        if time.time() > deadline:
            add("mlx-lm", "prefill", L, note="not measured (budget)")
            add("mlx-lm", "decode", L, note="not measured (budget)")
            return
        pf, dec, note = peer.prefill_then_decode(toks[:L], args.mlx_decode_steps)
        if note:
            add("mlx-lm", "prefill", L, note=note)
            add("mlx-lm", "decode", L, note=note)
            return
        add("mlx-lm", "prefill", L, pf["seconds"])
        add("mlx-lm", "decode", L, dec["seconds"], dec["steps"])

    for k, L in enumerate(sorted(set(args.lengths) | set(args.mlx_lengths))):
        engines = ([run_lily] if L in args.lengths else []) + ([run_mlx] if L in args.mlx_lengths else [])
        for fn in (engines if k % 2 == 0 else engines[::-1]):  # alternate which engine goes first
            fn(L)
        print(f"[{time.time() - t_start:.0f}s] L={L} done", flush=True)

    by = {(r["engine"], r["phase"], r["tokens"]): r for r in rows}
    for r in rows:
        m = by.get(("mlx-lm", r["phase"], r["tokens"]))
        if r["engine"].startswith("lily") and r["tok_s"] and m and m.get("tok_s"):
            r["ratio_to_mlx"] = r["tok_s"] / m["tok_s"]
    peer_note = " vs MLX-LM" if args.mlx_lengths else " (MLX-LM not run)"
    title = (f"lily-{args.backend}{peer_note}, {cfg.num_hidden_layers} layers hidden {cfg.hidden_size} "
             f"({'checkpoint' if folder else 'in-memory'}), {dev_name}, git {git_sha()[:10]}")
    res = {"hardware": {**hardware(), "gpu": dev_name, "copy_bandwidth_Bps": bw, "bf16_matmul_flops": mflops,
                        "host": platform.node()},
           "git_sha": git_sha(),
           "settings": {"title": title, "backend": args.backend, "config": args.config, "checkpoint": folder,
                        "lily_lengths": args.lengths, "mlx_lengths": args.mlx_lengths,
                        "decode_steps": args.decode_steps, "mlx_decode_steps": args.mlx_decode_steps,
                        "budget_s": args.budget_s, "load": load_info, "cost_model": cost.as_dict(),
                        "mlx": (peer.info if peer and peer.info else {"note": mlx_note or "disabled"}),
                        "order": "engines alternate which goes first per length",
                        "build": _lily.build_info(), "chunk": eng.default_chunk,
                        "method": "prefill: fresh state, last-row logits, host wall clock; decode: 3 untimed "
                                  "steps, then steps of forward + logits to host + argmax"},
           "rows": rows, "ablations": ablator.rows if ablator else [], "kernel_profiles": profiles,
           "counters": checks, "elapsed_s": time.time() - t_start}
    if args.llamacpp_json:
        add_llamacpp(rows, res["settings"], args.llamacpp_json, cost, bw, mflops)
    path = out / f"{args.name}.json"
    path.write_text(json.dumps(res, indent=1, default=float))
    plot_sweep(rows, title, out / f"{args.name}.png")
    if ablator:  # a run without ablations keeps the last table
        write_markdown(res, md_path)
    for k, prof in profiles.items():
        if isinstance(prof, dict) and "error" not in prof and "_total" in prof:
            print("\n" + format_profile(k, prof, 10))
        else:
            print(f"\n{k}: {prof}")
    if ablator:
        print("\nablations (tok/s, change vs default):")
        for r in ablator.rows:
            ch = f"{100 * r['change_vs_default']:+.1f}%" if r.get("change_vs_default") is not None else ""
            val = f"{r['tok_s']:.1f}" if r.get("tok_s") else r.get("note", "")[:50]
            print(f"  {r['flag']}={r['setting']} {r['phase']} {r['tokens']}: {val} {ch}")
    print(f"\nwrote {path}, {md_path}; elapsed {time.time() - t_start:.0f}s; counters {checks}")
    print(short_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
