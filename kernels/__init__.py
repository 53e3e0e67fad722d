"""Fused kernels (Triton) with torch references; models call them through ``kernels.dispatch``."""
