"""The bridge to AReaL 1.0.4: which names move, how a cell and a config move, and AReaL's trainer on the export.

- `compat`: the names shared with AReaL (`AREAL_NAMES`), the kit's own (`KIT_ONLY`), where the kit differs on purpose
  (`BETTER_THAN_AREAL`), cell conversion and the experiment export of notebook 08;
- `config`: a kit YAML as an AReaL config (`python -m areal_lite.kit.areal.config FILE -o areal.yaml`);
- `run`: the exported experiment under AReaL's own trainer on this CPU (`make areal-run`).
"""
