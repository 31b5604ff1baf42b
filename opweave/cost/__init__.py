"""The cost model shared by the analysis, the planner and the simulator."""
