"""DROID key map (RLDS ``droid`` 1.0.0/1.0.1 and ``droid_100``), as openpi trains pi0/pi0.5-DROID.

state = observation/joint_position(7) ++ observation/gripper_position(1, 0 = open, 1 = closed);
action = action_dict/joint_velocity(7) ++ action_dict/gripper_position(1, absolute, 1 = closed), 15 Hz.
The top-level ``action`` (cartesian_position ++ gripper, absolute) is deliberately not used: the
DROID maintainers call it only a default and point to ``action_dict`` (github.com/droid-dataset/droid issue #9).
Prompt: one of language_instruction / _2 / _3 per episode (``StandardizeOptions.language_choice``).
Optional filters (``StandardizeOptions``): ``idle_filter`` = openpi's non-idle ranges rule on
action_dict/joint_velocity; ``success_only`` = keep episodes whose ``file_path`` matches ``.*success.*``.
OpenVLA's per-trajectory swap of the two exterior cameras is an augmentation and lives in the loader, not here.
"""

from __future__ import annotations

from vla.data.keymaps import KeyMap, raw, register

LANGUAGE_KEYS = ("language_instruction", "language_instruction_2", "language_instruction_3")

DROID = register(
    KeyMap(
        dataset="droid",
        aliases=("droid_100",),
        embodiment="franka_droid",
        cameras={
            "primary": "observation/exterior_image_1_left",
            "secondary": "observation/exterior_image_2_left",
            "wrist": "observation/wrist_image_left",
        },
        language=LANGUAGE_KEYS,
        control_hz=15,
        action_space="joint_vel",
        state=(raw("observation/joint_position"), raw("observation/gripper_position")),
        action=(raw("action_dict/joint_velocity"), raw("action_dict/gripper_position")),
        features={
            "observation/joint_position": "float64[7]",
            "observation/gripper_position": "float64[1]",
            "action_dict/joint_velocity": "float64[7]",
            "action_dict/gripper_position": "float64[1]",
            **{k: "string" for k in LANGUAGE_KEYS},
        },
        idle_key="action_dict/joint_velocity",
        success_key="file_path",
        success_pattern=".*success.*",
        notes="Gripper kept 1 = closed (openpi, DROID policy code); OpenVLA's entry flips it and uses cartesian "
        "velocity instead. idle/success filters are opt-in via StandardizeOptions.",
        sources=(
            "droid-dataset/droid@1548722 docs/the-droid-dataset.md (RLDS features), droid/franka/robot.py (gripper)",
            "Physical-Intelligence/openpi@15a9616 src/openpi/training/droid_rlds_dataset.py, "
            "examples/droid/compute_droid_nonidle_ranges.py (filters)",
            "github.com/Physical-Intelligence/openpi issue #459 (7-D joint velocity + 1-D absolute gripper)",
        ),
    ),
    __name__,
)
