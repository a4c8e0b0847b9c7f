"""What the server's interleaving scheduler (lily.server.worker.EngineWorker) costs a stream: the bundled model on the
CPU, 256 greedy tokens (stop tokens biased away), 4 repeats of: Session.generate alone, one stream through the
worker, two concurrent streams through it. Prints tok/s per run (docs/server.md quotes a run).
    PYTHONPATH=src python3 dev/bench_scheduler.py
"""
import asyncio, time
import lily
from lily.sampling import resolve_sampling
from lily.prefix_cache import PrefixCache
from lily.server.worker import EngineWorker, Job

model = lily.load(threads=2)
print(model)
N = 256
bias = {t: -100.0 for t in model.stop_token_ids}
ids = model.tokenize("The engine of this small model runs on a CPU and")
sp = lambda: resolve_sampling(model.generation_config, max_tokens=N, temperature=0.0, logit_bias=bias)

def direct():
    s = model.session()
    n = 0
    for c in s.generate(ids, whole=True, stream=True, sampling=sp()):
        n += 1
        if n == 1: t1 = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t1)

async def through_worker(k):
    w = EngineWorker(model, PrefixCache(), parallel=4); w.start()
    loop = asyncio.get_running_loop()
    jobs = [Job(ids + [i + 1], sp(), loop) for i in range(k)]
    for j in jobs: w.submit(j)
    async def drain(j):
        n = 0; t1 = None
        while True:
            ev = await j.events.get()
            if ev[0] == "chunk":
                n += 1
                if n == 1: t1 = time.perf_counter()
            if ev[0] in ("end", "error"):
                return (n - 1) / (time.perf_counter() - t1)
    r = await asyncio.gather(*(drain(j) for j in jobs))
    w.stop(); return r

for rep in range(4):
    print("direct Session.generate     %.1f tok/s" % direct())
    print("worker, 1 stream            %.1f tok/s" % asyncio.run(through_worker(1))[0])
    r = asyncio.run(through_worker(2))
    print("worker, 2 streams           %.1f + %.1f tok/s (sum %.1f)" % (r[0], r[1], sum(r)))
