"""The `hubchain` policy: segchain, whose blocks stored right after a hub
(a block many requests branched from) age faster by an adaptive shift."""

from kvoffload.abstractions import ReqContext
from kvoffload.policies.hubchain import HubChainPolicy
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

from tests.policies.test_chain import keys, turn

HUB = HubChainPolicy.HUB


def test_branches_off_a_block_go_to_the_hub_order_once_it_is_a_hub():
    m = CPUOffloadingManager(64, "hubchain")
    pol = m.policy
    system = keys(0, 2)
    turn(m, system)
    for i in range(1, HUB + 1):
        turn(m, system + keys(i, 2))
    for i in range(1, HUB):  # branches 1..HUB-1: ordinary chain blocks
        assert not any(k in pol._hubbed for k in keys(i, 2))
    assert all(k in pol._hubbed for k in keys(HUB, 2))
    assert pol._branches[system[-1]] == HUB
    turn(m, system + keys(HUB, 2) + keys(99, 1))  # its first hit: a continued branch
    assert not any(k in pol._hubbed for k in keys(HUB, 2)) and all(k in pol._order for k in keys(HUB, 2))
    assert keys(99, 1)[0] in pol._order  # a continuation is no hub branch (its parent has one branch)


def _hub_and_chain(shift: float) -> tuple[CPUOffloadingManager, list[bytes], list[bytes]]:
    """A full cache: the hub and its first branches, a chain (stored before)
    and a hub branch (stored after it)."""
    m = CPUOffloadingManager(2 + (HUB - 1) + 4 + 2, "hubchain")
    system = keys(0, 2)
    turn(m, system)
    for i in range(1, HUB):
        turn(m, system + keys(i, 1))
    for i in range(1, HUB):  # keep the hub and its first branches in use
        turn(m, system + keys(i, 1))
    chain = keys(50, 4)
    turn(m, chain)
    turn(m, system + keys(HUB, 2))  # the hub branch, stored after the chain
    m.policy.shift = shift
    return m, chain, keys(HUB, 2)


def test_with_no_shift_the_older_goes_first_and_with_a_shift_the_hub_branch():
    m, _, branch = _hub_and_chain(0.0)
    assert all(k in m.policy._hubbed for k in branch)
    out = m.prepare_store(keys(70, 2), None)
    assert len(out.evicted_keys) == 2 and not set(out.evicted_keys) & set(branch)  # LRU: older blocks
    m, _, branch = _hub_and_chain(1000.0)
    out = m.prepare_store(keys(70, 2), None)
    assert sorted(out.evicted_keys) == sorted(branch)  # counted older by the shift


def test_shift_moves_with_ghost_hits_and_stays_within_the_caches_lifetime():
    pol = HubChainPolicy(8)
    pol._life, pol.shift = 8.0, 3.0  # one step = 8 / 8 = 1 request
    hub_ghost, rest_ghost = b"h" * 12, b"r" * 12
    pol._ghost_hub[hub_ghost] = None
    pol.insert([hub_ghost], None)  # a hub branch evicted too soon
    assert pol.shift == 2.0
    pol._ghost_rest[rest_ghost] = None
    pol.insert([rest_ghost], None)  # something else evicted too soon
    assert pol.shift == 3.0
    for i in range(20):
        k = bytes([i]) * 12
        pol._ghost_rest[k] = None
        pol.insert([k], None)
    assert pol.shift == 8.0  # capped at the lifetime
    assert not pol._ghost_hub and not pol._ghost_rest


def test_one_shot_prompts_after_a_preamble_lose_to_returning_conversations():
    """Many one-shot prompts branch off a shared preamble and are never read
    again; conversations (no shared prefix) come back. LRU order lets the
    one-shots push the conversations out; hubchain learns (from the
    conversations' ghosts) to let the one-shots go first."""
    hits = {}
    for policy in ("segchain", "hubchain"):
        m = CPUOffloadingManager(48, policy)
        pre = keys(0, 2)
        n = 0
        for r in range(60):
            for c in range(4):  # 4 conversations, a turn each round, growing
                n += turn(m, keys(1000 + c, 4 + r % 6))
            for s in range(3):  # 3 one-shot prompts of 4 new blocks each
                turn(m, pre + keys(10 * r + s + 1, 4))
        hits[policy] = n
    assert hits["hubchain"] > hits["segchain"], hits


def test_a_store_landing_after_the_finish_keeps_its_request_class():
    """vLLM finishes a request in the step it submits the last store; the
    store completes later and still goes to its request's order."""
    m = CPUOffloadingManager(64, "hubchain")
    system = keys(0, 2)
    turn(m, system)
    for i in range(1, HUB):
        turn(m, system + keys(i, 1))
    ctx = ReqContext("late")
    prompt = system + keys(HUB, 2)
    for i, k in enumerate(prompt):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    m.prepare_load(system, ctx)
    m.complete_load(system, ctx)
    out = m.prepare_store(prompt[2:], ctx)
    m.on_request_finished(ctx)
    m.complete_store(out.keys_to_store, ctx)
    assert all(k in m.policy._hubbed for k in keys(HUB, 2))
