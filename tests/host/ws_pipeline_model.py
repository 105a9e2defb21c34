"""Model of the mbarrier protocol of cpp/sm90/grouped_gemm_wgmma_ws.cuh (one producer agent standing for the
producer warpgroup, two consumer warpgroups; full count 1, empty count 2 here), run under random interleavings:
every stage a consumer reads holds the tile it expects, the producer never overwrites a stage whose wgmmas may
still be in flight, and nothing deadlocks. try_wait.parity(P) succeeds iff the barrier's completed-phase count
has parity != P (PTX mbarrier phase semantics). Mirrors the loop structure of ws_producer / ws_consumer."""
import random

class Bar:
    def __init__(s, count): s.count, s.pending, s.done = count, 0, 0
    def arrive(s):
        s.pending += 1
        if s.pending == s.count: s.pending, s.done = 0, s.done + 1
    def ready(s, parity): return (s.done & 1) != parity

def run(n, S, seed):
    rng = random.Random(seed)
    full = [Bar(1) for _ in range(S)]; empty = [Bar(2) for _ in range(S)]
    act = [None] * S; raw = [None] * S; wt = [None] * S
    in_use = [[False] * S for _ in range(2)]
    def load(slot, t):
        assert not any(in_use[c][slot] for c in range(2)), ("overwrite in use", slot, t)
        act[slot] = raw[slot] = t
    def producer():
        for s in range(S - 1):
            if s < n: load(s, s)
            yield
        for kt in range(n):
            slot = kt % S
            assert raw[slot] == kt
            assert not any(in_use[c][slot] for c in range(2)), "decode into slot in use"
            wt[slot] = kt
            full[slot].arrive(); yield
            pf = kt + S - 1
            if pf < n:
                if pf >= S:
                    while not empty[pf % S].ready((pf // S - 1) & 1): yield None
                load(pf % S, pf)
            yield
    def consumer(c):
        for kt in range(n):
            slot = kt % S
            while not full[slot].ready((kt // S) & 1): yield None
            assert act[slot] == kt and wt[slot] == kt, ("stale", c, kt, act[slot], wt[slot])
            in_use[c][slot] = True; yield
            if kt > 0:
                in_use[c][(kt - 1) % S] = False
                empty[(kt - 1) % S].arrive()
            yield
        if n: in_use[c][(n - 1) % S] = False
    agents = [producer(), consumer(0), consumer(1)]
    alive = list(range(3)); stuck = 0
    while alive:
        i = rng.choice(alive)
        try:
            r = next(agents[i])
            stuck = stuck + 1 if r is None else 0
        except StopIteration:
            alive.remove(i); stuck = 0
        if stuck > 10000: raise AssertionError(("deadlock", n, S, seed))

def check_all(seeds=60):
    for S in (4, 5):
        for n in range(1, 40):
            for seed in range(seeds):
                run(n, S, seed)


if __name__ == "__main__":
    check_all()
    print("protocol model ok")
