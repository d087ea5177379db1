"""A torch.distributed failure inside a collective, told as a TPCompileError: what, where, who, and what to do.

Gloo and NCCL report a dead or stalled peer in their own words ("Connection closed by peer
[127.0.0.1]:38607", "Timed out waiting 300000ms for recv operation"), naming no collective,
module or rank. Every tpcompile collective that calls torch.distributed catches the error
(`except RuntimeError`, which DistError and its subclasses are) and raises
`collective_error(...)` from it instead. All the work happens on that failure path: the fx node
that issued the collective is found by walking the Python stack to the rank GraphModule's
generated forward, and the rank that stopped answering by a short roll call in the group's
store. `translate(error, where=...)` does the same for torch's own collectives outside
tpcompile's ops (a pipeline's send/recv, say).
"""
from __future__ import annotations

import os
import re
import sys
import time
import weakref
from datetime import timedelta
from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.fx import GraphModule, Node

from tpcompile.errors import TPCompileError

__all__ = ["collective_error", "translate"]

# Seconds a failing rank waits for the group's other ranks to report to the store: long enough
# for survivors that failed at about the same time, short enough not to delay the job's end.
ROLL_CALL_S = 2.0
_KEY = "tpcompile/failed/{restart}/{rank}"
_GENERATED = "GeneratedBackwardFor_"
# Words by which gloo and NCCL say that a peer went away, or that a wait ran out.
_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|end of file|"
                   r"socket closed|remote process exited|peer.*(crash|exit)", re.I)
_TIMEOUT = re.compile(r"timed? ?out|timeout|watchdog|aborted", re.I)
# Groups already called once in this process: a group is broken after its first failure, so later
# collectives on it fail at once and need no second roll call.
_called: "weakref.WeakKeyDictionary[Any, Optional[list[int]]]" = weakref.WeakKeyDictionary()


def _cause(error: BaseException) -> str:
    """The first line of the backend's message, without the C++ source location it starts with."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    text = text.split(". ")[0].rstrip(".")  # gloo's advice after the first sentence is what we replace
    return text if len(text) <= 200 else text[:197] + "..."


def _kind(error: BaseException) -> str:
    """'gone' (a peer closed its connection), 'timeout' (a wait ran out) or 'failed'."""
    text = str(error)
    if _GONE.search(text):
        return "gone"
    if _TIMEOUT.search(text) or "pair closure" in text:
        return "timeout"
    return "failed"


def lost_peer(error: BaseException) -> bool:
    """True when the error says a peer closed its connection or a wait timed out (not a failure of the model code)."""
    return _kind(error) != "failed"


def _rank_frame() -> Optional[tuple[GraphModule, FrameType]]:
    """The innermost frame of a GraphModule's generated forward on this thread's stack, with its module."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<eval_with_key>"):
            gm = frame.f_locals.get("self")
            if isinstance(gm, GraphModule):
                return gm, frame
        frame = frame.f_back
    return None


def _graph_node() -> Optional[Node]:
    """The fx node whose line of generated code is running now (its collective called us), if any."""
    found = _rank_frame()
    if found is None:
        return None
    gm, frame = found
    lineno_map = getattr(gm, "_lineno_map", None) or {}
    # fx numbers the generated lines from the `def forward` line, as the code object does
    index = lineno_map.get(frame.f_lineno - frame.f_code.co_firstlineno)
    if index is None:
        return None
    for i, node in enumerate(gm.graph.nodes):
        if i == index:
            return node
    return None


def _module_path(node: Node) -> str:
    """The innermost module path in node's nn_module_stack ('' when none is recorded)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and not str(v[0]).startswith("_empty")]
    return paths[-1] if paths else ""


def _graph_op(node: Node) -> str:
    """'tpcompile.all_reduce', 'tpcompile.all_reduce.inplace', or the lowered op's 'tpcompile.all_gather (lowered)'."""
    if "tp_lowered" in node.meta:
        return f"{node.meta['tp_lowered']} (lowered to _c10d_functional)"
    name = str(node.target) if isinstance(node.target, torch._ops.OpOverload) else getattr(
        node.target, "__name__", str(node.target))
    return name.removesuffix(".default")


def _where_in_graph(node: Node) -> str:
    """'at transformer.h.0.attn.c_proj (node all_reduce_default_1)'."""
    path = _module_path(node)
    if not path:
        inputs = [a for a in node.all_input_nodes if _module_path(a)]
        path = f"the top level (on the output of {_module_path(inputs[0])})" if inputs else "the top level"
    return f"at {path} (node {node.name})"


def _phase() -> str:
    """'backward' while the autograd engine runs on this thread, else 'forward'."""
    return "backward" if torch._C._current_graph_task_id() >= 0 else "forward"


def _backward_of() -> str:
    """' of tpcompile.grad_all_reduce': the op whose backward is running, when autograd names it."""
    node = torch._C._current_autograd_node()
    if node is None:
        return ""
    name = node.name().removesuffix("Backward").lstrip("_")
    if name.startswith(_GENERATED):  # a custom op's autograd node: GeneratedBackwardFor_<ns>_<op>_<overload>
        ns, _, rest = name[len(_GENERATED):].partition("_")
        name = f"{ns}.{rest.removesuffix('_default')}"
    return f" of {name}"


def _group_ranks(pg: Any) -> list[int]:
    """The global ranks of pg (None: every process), in group order."""
    try:
        return list(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
    except (RuntimeError, ValueError, AttributeError):
        return []


def _timeout_s(pg: Any) -> float:
    """The group's collective timeout in seconds; unreadable, $TPCOMPILE_TIMEOUT_S, else torch's default."""
    group = pg if pg is not None else getattr(dist.group, "WORLD", None)
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, TypeError):
            continue
    try:
        return float(os.environ["TPCOMPILE_TIMEOUT_S"])
    except (KeyError, ValueError):
        return dist.default_pg_timeout.total_seconds()


def _roll_call(pg: Any, ranks: list[int], wait_s: float) -> Optional[list[int]]:
    """Global ranks of `ranks` that did not report a failure to the store within wait_s; None if the store is gone."""
    group = pg if pg is not None else dist.group.WORLD
    try:
        if group in _called:
            return _called[group]
    except TypeError:  # a group object that takes no weak reference: called each time
        group = None
    # torchrun's agent keeps its store across restarts: a restart's reports must not count for the next
    key = _KEY.format(restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), rank="{rank}")
    me = dist.get_rank()
    silent: Optional[list[int]] = None
    try:
        store = dist.distributed_c10d._get_default_store()
        before = store.timeout
        store.set_timeout(timedelta(seconds=wait_s))  # no store call may block longer than the roll call
        try:
            store.set(key.format(rank=me), str(os.getpid()))
            deadline = time.monotonic() + wait_s
            others = [r for r in ranks if r != me]
            while True:
                silent = [r for r in others if not store.check([key.format(rank=r)])]
                if not silent or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            store.set_timeout(before)
    except (RuntimeError, ValueError, AttributeError):  # the store (or its host process) is gone too
        silent = None
    if group is not None:
        _called[group] = silent
    return silent


def _who(pg: Any, kind: str, ranks: list[int]) -> tuple[str, str, str]:
    """(a sentence on which rank stopped answering, whose log to read first, that rank's name for the advice)."""
    if kind == "failed" or len(ranks) < 2 or not dist.is_initialized():
        return "", "read every rank's log for its first error", "a rank"
    silent = _roll_call(pg, ranks, ROLL_CALL_S)
    if silent is None:
        return (" The group's store did not answer either: the process hosting it (rank 0, or the torchrun "
                "agent) may be the one that died.", "read the log of the rank that exited first (torchrun "
                "prints each rank's exit code)", "a rank")

    def name(r: int) -> str:
        return f"rank {ranks.index(r)}" + (f" (global rank {r})" if ranks != list(range(len(ranks))) else "")

    if not silent:
        return (" Every other rank of the group failed too.", "read the log of the rank that failed first "
                "(compare the times): the others fail because it stopped", "a rank")
    names = ", ".join(name(r) for r in silent)
    why = ("its process ended (killed, out of memory, or exited)" if kind == "gone" else
           "it hangs, is stuck in slow work, or waits in a different collective")
    return (f" {names[0].upper()}{names[1:]} stopped answering: no failure reported within {ROLL_CALL_S:g} s; {why}.",
            f"read {names}'s log first: its own first error, or where it stopped, is the cause", names)


def _describe(error: BaseException, what: str, tensor: Optional[torch.Tensor], pg: Any) -> TPCompileError:
    """The TPCompileError for a torch.distributed failure in `what`."""
    kind = _kind(error)
    ranks = _group_ranks(pg)
    size = len(ranks) or (dist.get_world_size(pg) if dist.is_initialized() else 1)
    try:
        mine = dist.get_rank(pg) if dist.is_initialized() else 0
    except (RuntimeError, ValueError):
        mine = -1
    me = f"this process is rank {mine} of it" + (f", global rank {dist.get_rank()}"
                                                 if dist.is_initialized() and ranks != list(range(size)) else "")
    data = f" on a {tuple(tensor.shape)} {tensor.dtype} tensor" if isinstance(tensor, torch.Tensor) else ""
    timeout = _timeout_s(pg)
    happened = {"gone": "a peer closed its connection (its process ended)",
                "timeout": "a peer did not answer within the group's timeout",
                "failed": "the backend failed"}[kind]
    who, first, culprit = _who(pg, kind, ranks)
    raised = f"TPCOMPILE_TIMEOUT_S={max(2 * timeout, 60.0):g} in every rank's environment"
    advice = {"timeout": f"; if {culprit} was only slow (a long step, data load, checkpoint or compile on one "
                         f"rank), raise the timeout: {raised}",
              "gone": f"; raising the timeout ({raised}) helps a rank that is slow, not one that died",
              "failed": ""}[kind]
    return TPCompileError(
        f"{what}{data} in a group of {size} ({me}): {happened} ({type(error).__name__}: {_cause(error)}).{who} "
        f"The group's timeout is TPCOMPILE_TIMEOUT_S = {timeout:g} s. Way out: {first}{advice}.")


def collective_error(error: BaseException, op: str, tensor: Optional[torch.Tensor], pg: Any) -> TPCompileError:
    """The TPCompileError for torch.distributed's failure in a tpcompile collective `op` on tensor over pg."""
    phase = _phase()
    node = _graph_node() if phase == "forward" else None
    if node is not None and str(node.target) == "tpcompile_async.wait.default":
        start = node.args[0]  # the asynchronous all-reduce this wait completes: name it, and the wait
        what = (f"collective {_graph_op(start)} (forward, at its wait {node.name}) {_where_in_graph(start)}"
                if isinstance(start, Node) else f"collective {op} (forward) {_where_in_graph(node)}")
    elif node is not None:
        what = f"collective {_graph_op(node)} (forward) {_where_in_graph(node)}"
    elif phase == "backward":
        what = f"collective {op} in backward{_backward_of()}"
    else:
        what = f"collective {op} (forward, outside a rank graph)"
    return _describe(error, what, tensor, pg)


def translate(error: BaseException, *, where: str, group: Any = None,
              tensor: Optional[torch.Tensor] = None) -> TPCompileError:
    """A TPCompileError for a torch.distributed failure in `where` (a TPCompileError is returned as it is)."""
    if isinstance(error, TPCompileError):
        return error
    return _describe(error, where, tensor, group)
