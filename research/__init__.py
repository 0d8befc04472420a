"""Research probes and studies of the drafters on the demo target: one-off measurements that
the reports under docs/results and docs/experiments quote. Not part of the product: nothing
outside research/ and tests/ imports it (a contract in pyproject.toml).

- ``bound``: what a one-jump sampling drafter can reach on a target, measured before training;
- ``mode_probe``: drafts at held-out anchors under mode-seeking variants, and the denoiser at
  pure noise;
- ``map_fidelity``: a distilled flow map against its teacher's ODE, by jump length;
- ``two_jump_probe``: what the second zero-state jump changes in a map's T = 0 draft;
- ``second_jump_refiner``: trains a network of its own for that second jump
  (DrafterConfig.second_jump_net) and exports the map with it;
- ``joint_task`` on ``joint_world`` (report: ``joint_task_report``): a synthetic task whose
  continuations are known exactly.
"""
