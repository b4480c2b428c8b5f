"""A model of the pair variant's ring protocol (sm90_fwd64, pair=True; class docstring of
BlockSparseFwd64Sm90): one producer warp issuing a consumer's K / V loads in the order of
`_producer_pair`, the TMA landing them, and the consumer's warps walking the union as
`_consumer_pair` does (waits and releases in its order). The mbarriers are modelled with their
parity semantics (a wait on parity P passes while the barrier's completed-phase count is odd
when P is 0 and even when P is 1), so a wait that passes on the wrong phase fails the model, and
random schedules over random membership sequences must always finish. The control: the order
of `_producer` (K_t before V_{t-1} whatever the memberships) deadlocks at k_stages=1. CPU only."""

import random

import pytest


def consumer_events(masks):
    """("wait" | "release", ring, union entry) in the order `_consumer_pair` runs them."""
    ev = []
    n = len(masks)
    if n == 0:
        return ev
    state = dict(pend_t=0, v_last=0)

    def step(t, pending):
        if pending and state["v_last"] != state["pend_t"]:
            ev.append(("release", "v", state["v_last"]))
        ev.append(("wait", "k", t))
        if pending:
            ev.append(("wait", "v", state["pend_t"]))
            state["v_last"] = state["pend_t"]

    m = masks[0]
    if m & 1:
        step(0, False)
        if m & 2:
            step(0, True)
    else:
        step(0, False)
    for t in range(1, n):
        ev.append(("release", "k", t - 1))
        if masks[t] & 1:
            step(t, True)
            state["pend_t"] = t
        if masks[t] & 2:
            step(t, True)
            state["pend_t"] = t
    if state["v_last"] != state["pend_t"]:
        ev.append(("release", "v", state["v_last"]))
    ev += [("wait", "v", state["pend_t"]), ("release", "v", state["pend_t"]), ("release", "k", n - 1)]
    return ev


def producer_loads(masks, by_membership=True):
    """The loads of `_producer_pair` in issue order; by_membership=False: `_producer`'s order."""
    n = len(masks)
    seq = []
    for t in range(n + 1):
        if t < n:
            seq.append(("k", t))
        if t >= 1 and (masks[t - 1] != 3 or not by_membership):
            seq.append(("v", t - 1))
        if t < n and masks[t] == 3 and by_membership:
            seq.append(("v", t))
    return seq


def run(masks, stages, warps=4, seed=0, by_membership=True):
    """True when the producer, the TMA and every consumer warp finish under a random schedule, False
    on a deadlock; AssertionError when a wait passes on the wrong phase or a slot is refilled early."""
    rng = random.Random(seed)
    events = consumer_events(masks)
    loads = producer_loads(masks, by_membership)
    assert sorted(loads) == sorted([("k", t) for t in range(len(masks))] + [("v", t) for t in range(len(masks))])
    full = {r: [0] * stages[r] for r in "kv"}       # completed phases (fills landed) per slot
    empty = {r: [0] * stages[r] for r in "kv"}      # completed phases (all warps released) per slot
    arrivals = {r: [0] * stages[r] for r in "kv"}   # arrivals toward the current empty phase
    in_flight = []                                  # issued loads not landed yet
    at = [0] * warps
    issued = 0
    while True:
        moves = []
        if issued < len(loads):
            r, t = loads[issued]
            s = stages[r]
            if t < s or empty[r][t % s] % 2 != (t // s + 1) % 2:  # the producer's empty wait passes
                moves.append(("producer", None))
        if in_flight:
            moves.append(("tma", None))
        for w in range(warps):
            if at[w] < len(events):
                kind, r, t = events[at[w]]
                if kind == "release" or full[r][t % stages[r]] % 2 != (t // stages[r]) % 2:
                    moves.append(("warp", w))
        if not moves:
            return issued == len(loads) and not in_flight and all(a == len(events) for a in at)
        who, w = rng.choice(moves)
        if who == "producer":
            r, t = loads[issued]
            s = stages[r]
            # the slot's previous fill (entry t - s) has been released by every warp, and no later one
            assert empty[r][t % s] == t // s, ("refill on the wrong phase", r, t, empty[r][t % s])
            in_flight.append((r, t))
            issued += 1
        elif who == "tma":
            r, t = in_flight.pop(rng.randrange(len(in_flight)))
            full[r][t % stages[r]] += 1
        else:
            kind, r, t = events[at[w]]
            s = stages[r]
            if kind == "wait":
                assert full[r][t % s] == t // s + 1, ("wait passed on the wrong phase", r, t, full[r][t % s])
            else:
                assert full[r][t % s] == t // s + 1, ("release of a fill that has not landed", r, t)
                arrivals[r][t % s] += 1
                if arrivals[r][t % s] == warps:
                    arrivals[r][t % s] = 0
                    empty[r][t % s] += 1
            at[w] += 1


def random_masks(rng, n, p_both):
    return [3 if rng.random() < p_both else rng.choice([1, 2]) for _ in range(n)]


@pytest.mark.parametrize("k_stages,v_stages", [(2, 2), (1, 1), (1, 2), (2, 1), (3, 4)])
def test_pair_rings_never_deadlock(k_stages, v_stages):
    rng = random.Random(k_stages * 10 + v_stages)
    for trial in range(200):
        masks = random_masks(rng, rng.choice([0, 1, 2, 3, 5, 12, 40]), rng.random())
        assert run(masks, {"k": k_stages, "v": v_stages}, warps=rng.choice([1, 4]), seed=trial), (masks, k_stages,
                                                                                                   v_stages)


def test_every_entry_released_once():
    """Each K and V fill is released once per warp (none held at the end, none released twice)."""
    rng = random.Random(3)
    for _ in range(200):
        masks = random_masks(rng, rng.randint(1, 30), rng.random())
        ev = consumer_events(masks)
        for r in "kv":
            assert sorted(t for kind, rr, t in ev if kind == "release" and rr == r) == list(range(len(masks)))


def test_with_the_plain_producer_order_the_model_deadlocks():
    rng = random.Random(5)
    found = False
    for trial in range(100):
        masks = random_masks(rng, 12, 0.5)
        if not run(masks, {"k": 1, "v": 2}, warps=1, seed=trial, by_membership=False):
            found = True
            break
    assert found, "the control should find a deadlock with K_{t+1} issued before V_t"
