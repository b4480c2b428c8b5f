"""A model of the shared-KV rings' protocol of sm90_fwd64 (shared_kv=True; class docstring of
BlockSparseFwd64Sm90): producers filling the K and V rings in union order, consumers walking the
union (own entries computed with PV_{j-1} held across the wait for K(u_j), the others passed),
with the drain rule. Random schedules over random lists must always finish; without the drain
rule the model finds the deadlock the rule exists for (the control). CPU only, no kernel."""

import random

import pytest


def consumer_events(own, n_union, v_stages, drain_rule=True):
    """The order of ("wait" | "release", ring, entry) events of one consumer, as `_consumer_shared` runs."""
    ev = []

    def pass_entries(a, b):
        for t in range(a, b):
            ev.extend([("wait", "k", t), ("release", "k", t), ("wait", "v", t), ("release", "v", t)])

    if not own:
        pass_entries(0, n_union)
        return ev
    pass_entries(0, own[0])
    ev += [("wait", "k", own[0]), ("release", "k", own[0])]
    prev, v_held = own[0], None
    for u in own[1:]:
        if v_held is not None:
            ev.append(("release", "v", v_held))
        drain = drain_rule and u - prev >= v_stages
        if drain:
            ev += [("wait", "v", prev), ("release", "v", prev)]
        pass_entries(prev + 1, u)
        ev.append(("wait", "k", u))
        if not drain:
            ev.append(("wait", "v", prev))
        ev.append(("release", "k", u))
        v_held = None if drain else prev
        prev = u
    if v_held is not None:
        ev.append(("release", "v", v_held))
    ev += [("wait", "v", prev), ("release", "v", prev)]
    pass_entries(prev + 1, n_union)
    return ev


def run(lists, stages, drain_rule=True, seed=0):
    """True when every consumer and producer finishes under a random schedule, False on a deadlock."""
    rng = random.Random(seed)
    union = sorted(set().union(*map(set, lists)))
    pos = {blk: i for i, blk in enumerate(union)}
    events = [consumer_events([pos[b] for b in sorted(lst)], len(union), stages["v"], drain_rule) for lst in lists]
    at = [0] * len(lists)
    filled = {"k": 0, "v": 0}  # entries loaded so far, in order
    released = {r: [0] * len(union) for r in "kv"}  # consumers that released each entry
    while True:
        moves = []
        for r in "kv":
            t = filled[r]
            if t < len(union) and (t < stages[r] or released[r][t - stages[r]] == len(lists)):
                moves.append(("producer", r))
        for c, ev in enumerate(events):
            if at[c] < len(ev):
                kind, r, t = ev[at[c]]
                if kind == "release" or filled[r] > t:
                    moves.append(("consumer", c))
        if not moves:
            return all(at[c] == len(ev) for c, ev in enumerate(events)) and filled["k"] == filled["v"] == len(union)
        who, x = rng.choice(moves)
        if who == "producer":
            filled[x] += 1
        else:
            kind, r, t = events[x][at[x]]
            if kind == "release":
                released[r][t] += 1
            at[x] += 1


def random_lists(rng, group, n_kv, topk, overlap):
    base = rng.sample(range(n_kv), topk)
    return [sorted(set(rng.sample(base, int(topk * overlap))) | set(rng.sample(range(n_kv), topk - int(topk * overlap))))
            for _ in range(group)]


@pytest.mark.parametrize("group,k_stages,v_stages", [(2, 5, 7), (3, 4, 7), (3, 2, 4), (3, 1, 2), (2, 1, 1)])
def test_shared_rings_never_deadlock(group, k_stages, v_stages):
    rng = random.Random(group * 100 + k_stages * 10 + v_stages)
    for trial in range(150):
        lists = random_lists(rng, group, rng.choice([8, 40, 200]), rng.randint(0, 8) or 1, rng.random())
        if trial % 10 == 0:
            lists[rng.randrange(group)] = []  # an empty list (or a member past the last query block)
        assert run(lists, {"k": k_stages, "v": v_stages}, seed=trial), (lists, k_stages, v_stages)


def test_without_the_drain_rule_the_model_deadlocks():
    rng = random.Random(5)
    found = False
    for trial in range(300):
        lists = random_lists(rng, 3, 40, 8, 0.2)
        if not run(lists, {"k": 2, "v": 2}, drain_rule=False, seed=trial):
            found = True
            break
    assert found, "the control should find a deadlock without the drain rule"
