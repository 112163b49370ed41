import sys, time, gc, cProfile, pstats
sys.path.insert(0, "benchmarks")
import passes as B
import placement as pl
n = int(sys.argv[1])
m = B.build(n)
acts = pl.get_activation_blobs(m)
block = [a for i, a in enumerate(acts) if (i // 4) % 2 == 1]
t=time.perf_counter(); pl.shift_activation_devices(m, block, {0: 1}); print("shift", time.perf_counter()-t)
if len(sys.argv) > 2:
    pr = cProfile.Profile(); pr.enable()
t=time.perf_counter(); r = pl.inject_cross_device_copies(m); print("inject", time.perf_counter()-t, r.seconds)
if len(sys.argv) > 2:
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
