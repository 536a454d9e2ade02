"""Pipeline schedules: each rank's order of forward/backward actions for one step, the send/recv program that
runs it, and a simulator that shows a schedule cannot hang. Pure Python: no torch, no process group.

A schedule function gives one rank its list of actions (op, micro-batch, chunk), built once per Pipeline (pp.py):
F runs a chunk's forward, B its backward; under ZB-H1 B is the input gradient only and W the weight gradient.
Chunk c lives on pp rank c % p. F receives its input from chunk-1's rank and sends its output to chunk+1's; B the
reverse, with gradients. `program` turns a list into posts (the previous action's send with the next one's
receive in one batch_isend_irecv; no shape handshake: every message is the pipeline's act_shape of act_dtype),
waits (just before a received tensor is used) and runs. `simulate` runs all ranks' programs together under the
strictest pairing NCCL allows (each rank's batches complete in posting order, a message once both ends are
posted), so a schedule it accepts cannot hang (nccl#479); `bubble` gives a schedule's idle share at unit costs,
to set beside measured bubbles (bench/bench_pp.py). `forward_only` (validation: Pipeline.evaluate) is the
forwards of interleaved 1F1B's order, any m.

Used by pp.py; tested by tests/test_pp.py (every schedule through `simulate`, bubbles against the formulas).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


# ----------------------------------------------------------------------------------------------------------------
# schedules: per rank, the order of its actions


@dataclass(frozen=True)
class Action:
    """Run `op` on micro-batch `mb` of global chunk `chunk`: first receive from rank `recv`, then send to `send`."""
    op: str            # "F" forward | "B" backward (input grad, and weight grad unless the schedule has W) | "W"
    mb: int
    chunk: int         # lives on rank chunk % p
    recv: int | None   # F: the activation from chunk-1's rank; B: the output's gradient from chunk+1's rank
    send: int | None   # F: the activation to chunk+1's rank; B: the input's gradient to chunk-1's rank
    joint: bool = False  # shares the previous action's communication batches (see `program`)


def _act(op: str, mb: int, chunk: int, p: int, n: int, joint: bool = False) -> Action:
    prev = (chunk - 1) % p if chunk > 0 else None
    nxt = (chunk + 1) % p if chunk < n - 1 else None
    return Action(op, mb, chunk, *{"F": (prev, nxt), "B": (nxt, prev), "W": (None, None)}[op], joint)


def gpipe(p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards. Holds m micro-batches' activations."""
    return [_act(op, i, rank, p, p) for op in "FB" for i in range(m)]


def one_f_one_b(p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """1F1B (PipeDream, Narayanan et al. 2019), flushed every step (PipeDream-Flush, as in Megatron-LM): holds at
    most p - rank micro-batches' activations, against GPipe's m; the same bubble, (p-1)/m of the ideal step."""
    F_, B_ = (lambda i: _act("F", i, rank, p, p)), (lambda i: _act("B", i, rank, p, p))
    warm = min(p - 1 - rank, m)
    acts = [F_(i) for i in range(warm)]                     # warm-up: fill the pipeline downstream of this rank
    for i in range(m - warm):                               # steady: one forward, one backward
        acts += [F_(warm + i), B_(i)]
    return acts + [B_(i) for i in range(m - warm, m)]       # cool-down: drain the backwards


def interleaved(p: int, m: int, rank: int, v: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): rank holds chunks rank, rank+p, ... Its k-th forward
    runs local chunk (k mod pv) // p on micro-batch (k // pv)*p + k mod p: micro-batches go through in groups of p,
    backwards walk the chunks in reverse. Warm-up (p-1-rank)*2 + (v-1)*p forwards; bubble (p-1)/(v*m) of the ideal."""
    def at(k, op, joint=False):
        j = (k % (p * v)) // p
        return _act(op, (k // (p * v)) * p + k % p, (v - 1 - j if op == "B" else j) * p + rank, p, p * v, joint)

    total = m * v
    # m == p: every forward first (Megatron-LM does the same; the steady pairs would wait on each other)
    warm = total if m == p else min((p - 1 - rank) * 2 + (v - 1) * p, total)
    acts = [at(k, "F") for k in range(warm)]
    for k in range(total - warm):  # steady: F and B exchange their messages in one batch, both directions
        acts += [at(warm + k, "F"), at(k, "B", joint=True)]
    return acts + [at(k, "B") for k in range(total - warm, total)]


def zb_h1(p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's forwards and backwards, with each
    backward split into B (input gradient: the rank upstream waits for it) and W (weight gradient: nobody waits).
    Rank r runs W(i - r) after B(i) and its last r W's at the end, where 1F1B's cool-down would idle: at most p
    micro-batches in flight on any rank (1F1B's peak) and, with equal F, B and W times, a bubble of
    (p-1)/(3m+p-1) of the step against 1F1B's (p-1)/(m+p-1)."""
    acts = []
    for a in one_f_one_b(p, m, rank):
        acts.append(a)
        if a.op == "B" and a.mb >= rank:
            acts.append(_act("W", a.mb - rank, rank, p, p))
    return acts + [_act("W", i, rank, p, p) for i in range(m - rank, m)]


def forward_only(p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """Validation: interleaved 1F1B's forwards in its order (v = 1: GPipe's), micro-batches in groups of p; the
    last group may be partial, so any m >= 1 works. Nothing is kept for a backward."""
    acts = []
    for k in range(-(-m // p) * p * v):
        j, mb = (k % (p * v)) // p, (k // (p * v)) * p + k % p
        if mb < m:
            acts.append(_act("F", mb, j * p + rank, p, p * v))
    return acts


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb": zb_h1}


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's action list for one step of m micro-batches; a bad setting is one clear ValueError."""
    if name not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={name!r}: expected one of {', '.join(SCHEDULES)}")
    if (name == "interleaved") != (v > 1):
        raise ValueError(f"parallel.pp_virtual={v}: pp_schedule='interleaved' needs pp_virtual >= 2, "
                         f"and the other schedules need pp_virtual=1 (got pp_schedule={name!r})")
    if m < 1:
        raise ValueError(f"a pipeline step needs at least one micro-batch, got {m}")
    # 1F1B-type schedules: fewer micro-batches than stages leaves the pipeline idle most of the step
    if name != "gpipe" and m < p:
        raise ValueError(f"parallel.pp_schedule={name!r} needs at least parallel.pp={p} micro-batches per step, "
                         f"got {m}: raise train.tokens_per_step or lower train.micro_batch (or use 'gpipe')")
    if name == "interleaved" and p == 1:
        raise ValueError("parallel.pp_schedule='interleaved' needs parallel.pp > 1")
    if name == "interleaved" and m % p:
        raise ValueError(f"parallel.pp_schedule='interleaved' runs micro-batches in groups of parallel.pp={p}: "
                         f"{m} micro-batches per step is not a multiple of it")
    return [SCHEDULES[name](p, m, r, v) for r in range(p)]


# ----------------------------------------------------------------------------------------------------------------
# communication program and its simulator


def message_label(a: Action, side: str) -> tuple:
    """What a message carries: ("act" | "grad", micro-batch, the chunk that consumes it)."""
    if side == "recv":
        return ("act" if a.op == "F" else "grad", a.mb, a.chunk)
    return ("act", a.mb, a.chunk + 1) if a.op == "F" else ("grad", a.mb, a.chunk - 1)


def program(actions: list[Action]) -> list[tuple]:
    """The executor's exact steps for one rank: ("post", sends, recvs) with [(peer, label)], ("wait",), ("run", a).
    A batch holds the sends of the previous action (or joint pair) and the receives of the next, so neighbours
    that send to each other at the same point of the schedule post both messages in one group (1F1B: Megatron's
    send_forward_recv_backward); it is waited on right before the actions that need what it receives."""
    groups = []
    for a in actions:
        if a.joint and groups:
            groups[-1].append(a)
        else:
            groups.append([a])
    steps, sends = [], []
    for group in groups:
        recvs = [(a.recv, message_label(a, "recv")) for a in group if a.recv is not None]
        if sends or recvs:
            steps.append(("post", sends, recvs))
        if recvs:
            steps.append(("wait",))
        steps += [("run", a) for a in group]
        sends = [(a.send, message_label(a, "send")) for a in group if a.send is not None]
    return steps + ([("post", sends, [])] if sends else [])


def simulate(actions: list[list[Action]]) -> list[tuple[int, Action]]:
    """Run every rank's program together; returns the (rank, action) order it ran in. Raises ValueError on a
    message whose two ends disagree, an action on the wrong rank, a micro-batch's F/B/W out of order or not run
    exactly once per chunk, or a deadlock. Pairing as on NCCL, strictest case: the k-th send from r to s meets
    the k-th receive on s from r; a rank's batches complete in posting order (one stream); a message completes
    when the batches of both its ends head their queues; "wait" blocks until all the rank has posted completes."""
    p, progs, sent, recvd = len(actions), [], {}, {}  # (src, dst) -> labels, in posting order
    for r, acts in enumerate(actions):
        prog = []
        for step in program(acts):
            if step[0] == "post":  # name each message (src, dst, k): the k-th on its channel
                batch = []
                for peers, box, is_send in ((step[1], sent, True), (step[2], recvd, False)):
                    for peer, label in peers:
                        ch = (r, peer) if is_send else (peer, r)
                        box.setdefault(ch, []).append(label)
                        batch.append((*ch, len(box[ch])))
                step = ("post", batch)
            prog.append(step)
        progs.append(prog)
    for ch in sorted(sent.keys() | recvd.keys()):
        if sent.get(ch, []) != recvd.get(ch, []):
            raise ValueError(f"messages from rank {ch[0]} to rank {ch[1]} do not pair up: sent {sent.get(ch, [])}, "
                             f"received {recvd.get(ch, [])}")
    ops = "".join(op for op in "FBW" if any(a.op == op for acts in actions for a in acts))  # F only: validation
    queue, pc, done, ran = [deque() for _ in range(p)], [0] * p, set(), []
    progress = True
    while progress:
        progress = False
        for r in range(p):  # hosts: run until a wait on batches not yet complete
            while pc[r] < len(progs[r]) and not (progs[r][pc[r]][0] == "wait" and queue[r]):
                step, pc[r], progress = progs[r][pc[r]], pc[r] + 1, True
                if step[0] == "post":
                    queue[r].append(step[1])
                elif step[0] == "run":
                    a = step[1]
                    before = ops[ops.index(a.op) - 1] if a.op != "F" else None
                    if a.chunk % p != r:
                        raise ValueError(f"rank {r} runs {a}, but chunk {a.chunk} lives on rank {a.chunk % p}")
                    if (a.op, a.mb, a.chunk) in done or (before and (before, a.mb, a.chunk) not in done):
                        raise ValueError(f"rank {r}: {a.op} of micro-batch {a.mb}, chunk {a.chunk} runs twice or "
                                         f"before its {before}")
                    done.add((a.op, a.mb, a.chunk))
                    ran.append((r, a))
        at_head = [msg for q in queue if q for msg in q[0]]  # devices: both ends at the heads -> complete
        done |= {msg for msg in at_head if at_head.count(msg) == 2}
        for q in queue:
            if q and all(msg in done for msg in q[0]):
                q.popleft()
                progress = True
    stuck = [f"rank {r} at {progs[r][pc[r]] if pc[r] < len(progs[r]) else 'the end'}"
             for r in range(p) if pc[r] < len(progs[r]) or queue[r]]
    if stuck:
        raise ValueError("pipeline schedule deadlocks: " + "; ".join(stuck))
    m, n = max(a.mb for _, a in ran) + 1, max(a.chunk for _, a in ran) + 1
    missing = {(op, i, c) for op in ops for i in range(m) for c in range(n)} - done
    if missing:
        raise ValueError(f"the schedule never runs {sorted(missing)[:4]} (every op in {ops} of every micro-batch "
                         f"< {m} on every chunk < {n} must run once)")
    return ran


def bubble(actions: list[list[Action]]) -> float:
    """The idle share of a step when F, B and W each take one unit (B two where it includes W; a chunk of a
    rank holding v chunks 1/v of that) and messages are free: the schedule's bubble, for comparison with the
    measured one. GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1); ZB-H1: (p-1)/(3m+p-1)."""
    p, n = len(actions), max(a.chunk for acts in actions for a in acts) + 1
    split = any(a.op == "W" for a in actions[0])
    cost = {"F": p / n, "B": (1 if split else 2) * p / n, "W": p / n}
    end, free, pc = {}, [0.0] * p, [0] * p
    while any(pc[r] < len(actions[r]) for r in range(p)):
        for r in range(p):
            while pc[r] < len(actions[r]):
                a = actions[r][pc[r]]
                deps = {"F": [("F", a.mb, a.chunk - 1)] if a.chunk > 0 else [],
                        "B": [("F", a.mb, a.chunk)] + ([("B", a.mb, a.chunk + 1)] if a.chunk < n - 1 else []),
                        "W": [("B", a.mb, a.chunk)]}[a.op]
                if any(d not in end for d in deps):
                    break
                end[(a.op, a.mb, a.chunk)] = free[r] = max([free[r]] + [end[d] for d in deps]) + cost[a.op]
                pc[r] += 1
    work = sum(cost[a.op] for a in actions[0])
    return 1 - work / max(free)
