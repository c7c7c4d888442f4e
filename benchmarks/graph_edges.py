"""Which dependencies a captured CUDA graph kept: programmatic (PDL) edges vs full serialisation.

A kernel launched with programmatic dependent launch inside stream capture becomes a graph node whose
in-edge has type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC. A graph that lost those edges still runs
correctly, only without the overlap, so the profile benchmark checks them here: it reads the graph
(torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()) through the CUDA driver API (libcuda, via
ctypes: no extra package), counts kernel nodes and edges by type, and names the kernels on each side.
"""
from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass, field

CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1
# The Triton kernels of nanoserve.kernels: each is launched with launch_pdl when PDL is on.
PDL_KERNELS = frozenset({"_gemv_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel", "_qk_norm_rope_kernel",
                         "_decode_kernel", "_decode_reduce_kernel", "_store_kv_kernel", "_prefill_kernel"})


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS (v2)
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@dataclass
class GraphEdges:
    kernel_nodes: int = 0
    other_nodes: int = 0
    edges: int = 0
    programmatic_edges: int = 0
    # PDL kernels whose predecessor is a kernel node but whose in-edge is not programmatic: the lost overlap
    pdl_kernels_without_programmatic_edge: int = 0
    programmatic_pairs: Counter = field(default_factory=Counter)  # "from -> to" kernel names

    def as_dict(self) -> dict:
        return {"kernel_nodes": self.kernel_nodes, "other_nodes": self.other_nodes, "edges": self.edges,
                "programmatic_edges": self.programmatic_edges,
                "pdl_kernels_without_programmatic_edge": self.pdl_kernels_without_programmatic_edge,
                "programmatic_pairs": dict(self.programmatic_pairs.most_common(12))}


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphGetEdges_v2", "cuGraphKernelNodeGetParams_v2",
                 "cuFuncGetName", "cuKernelGetName"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def _kernel_name(lib, node) -> str:
    """The kernel's name, or "?" where this driver cannot tell (names only label the report)."""
    params = _KernelNodeParams()
    if not hasattr(lib, "cuGraphKernelNodeGetParams_v2") or not hasattr(lib, "cuFuncGetName") or \
            lib.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)) != 0:
        return "?"
    name = ctypes.c_char_p()
    if params.func and lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)) == 0 and name.value:
        return name.value.decode(errors="replace")
    if params.kern and hasattr(lib, "cuKernelGetName") and \
            lib.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)) == 0 and name.value:
        return name.value.decode(errors="replace")
    return "?"


def _short(name: str) -> str:
    return name if len(name) <= 40 else name[:37] + "..."


def inspect_graph(raw_graph: int) -> GraphEdges:
    """Nodes and edges of a cudaGraph_t (an int, as CUDAGraph.raw_cuda_graph() returns it)."""
    lib = _driver()
    graph = ctypes.c_void_p(raw_graph)
    names = _node_names(lib, graph)
    if not hasattr(lib, "cuGraphGetEdges_v2"):
        raise RuntimeError("the driver has no cuGraphGetEdges_v2 (CUDA 12.3+): edge types are not readable")
    n_edges = ctypes.c_size_t(0)
    _check(lib.cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(n_edges)), "cuGraphGetEdges_v2")
    src, dst = (ctypes.c_void_p * n_edges.value)(), (ctypes.c_void_p * n_edges.value)()
    data = (_EdgeData * n_edges.value)()
    _check(lib.cuGraphGetEdges_v2(graph, src, dst, data, ctypes.byref(n_edges)), "cuGraphGetEdges_v2")
    out = GraphEdges(kernel_nodes=sum(v is not None for v in names.values()),
                     other_nodes=sum(v is None for v in names.values()), edges=n_edges.value)
    programmatic_into, kernel_pred = set(), set()
    for a, b, d in zip(src[:n_edges.value], dst[:n_edges.value], data[:n_edges.value]):
        if names.get(a) is not None:
            kernel_pred.add(b)
        if d.type == CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC:
            out.programmatic_edges += 1
            programmatic_into.add(b)
            out.programmatic_pairs[f"{_short(names.get(a) or '?')} -> {_short(names.get(b) or '?')}"] += 1
    out.pdl_kernels_without_programmatic_edge = sum(
        1 for node, name in names.items()
        if name in PDL_KERNELS and node in kernel_pred and node not in programmatic_into)
    return out



def _node_names(lib, graph) -> dict[int, str | None]:
    """Every node of the graph → its kernel name, None for other node types (memcpy, event, host...)."""
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    names: dict[int, str | None] = {}
    for node in nodes[:count.value]:
        node_type = ctypes.c_int()
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(node_type)), "cuGraphNodeGetType")
        names[node] = _kernel_name(lib, ctypes.c_void_p(node)) if node_type.value == CU_GRAPH_NODE_TYPE_KERNEL else None
    return names


def kernel_names(raw_graph: int) -> list[str]:
    """The kernel names of a cudaGraph_t's kernel nodes ("?" where the driver cannot tell), in node order."""
    return [n for n in _node_names(_driver(), ctypes.c_void_p(raw_graph)).values() if n is not None]
