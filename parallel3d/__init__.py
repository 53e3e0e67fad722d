"""parallel3d: readable 3D-parallel (TP x PP x DP/ZeRO) LLM pretraining in PyTorch."""

from parallel3d.topology import Coords, LayoutError, Topology

__all__ = ["Coords", "LayoutError", "Topology"]
__version__ = "0.1.0"
