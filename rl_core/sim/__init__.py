"""Cluster-scale simulation (issue 19): Steep's own loop against GPU-time stand-ins.

``clock`` (simulated time for asyncio), ``cost`` (H100 cost models), ``server`` (an SGLang
stand-in), ``trainer`` (a trainer stand-in), ``cluster`` (a dataset run), ``agents`` (online
agents). Imports neither Django nor torch; ``bench/cluster_sim.py`` runs the sweeps.
"""
