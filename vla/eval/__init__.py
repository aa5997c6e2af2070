"""Evaluation and the reality gap (``vla eval``). Modules, one job each:

- ``policies`` / ``remote``  what is evaluated: a checkpoint (``vla.policy.Policy``), a served policy, the scripted
                             ``expert`` or ``random``, behind one interface
- ``rollout``   closed-loop episodes in the sim envs (seeded per episode, spawned workers) -> ``results.json``
- ``stats``     success rates with 95 % Wilson intervals, per task / embodiment / randomization level
- ``metrics``   sim-vs-reference agreement: Pearson r, MMRV (SimplerEnv's), Kendall τ
- ``sweep``     success vs. severity of one randomization source at a time, plus ``reality_proxy``
- ``gap``       ``vla eval gap``: agreement of sim runs with a reference (CSV of real rates or other runs)
- ``state_env`` the sim env without cameras (replay, sysid) and the re-application of a stored randomization record
- ``replay``    open-loop replay of logged actions in the sim: per-step state divergence
- ``bridge``    replay of the Open X-Embodiment Bridge (WidowX) logs on the sim WidowX through IK
- ``sysid``     fit sim parameters to logs by minimizing replay error (CMA-ES) -> a randomization preset
- ``report``    one self-contained offline HTML page over eval runs
- ``cli``       the ``vla eval`` sub-commands
"""
