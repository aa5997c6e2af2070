"""Open X-Embodiment key maps, non-Franka robots (Franka datasets: ``oxe_franka.py``; DROID: ``droid.py``).

One entry per dataset of the Octo/OpenVLA ``oxe_magic_soup`` mixtures, from the peers' published per-dataset configs
and standardization transforms (``OXE_SOURCE``: cameras, state and action keys, gripper conversions). Conventions follow OpenVLA where it and Octo differ, except: language
is never blanked (Octo blanks 12 datasets; OpenVLA keeps the text), state layouts are the embodiment spec's (no
OpenVLA pad dim), and datasets without a rotation or gripper get a narrower action (jaco_play, language_table)
instead of constant padding. Raw feature widths are those of the TFDS catalog pages of the listed versions.
"""

from __future__ import annotations

from vla.data.keymaps import OXE_SOURCE, REL2ABS_SOURCE, KeyMap, raw, register, zeros

# RT-X (Google) layout keys shared by the datasets converted in the original OXE release.
NLI = "observation/natural_language_instruction"
LI = "language_instruction"
WV = "action/world_vector"
RD = "action/rotation_delta"
GCA = "action/gripper_closedness_action"
OG = "action/open_gripper"
RTX_ACTION = {WV: "float32[3]", RD: "float32[3]"}


def _add(km: KeyMap) -> None:
    register(km, __name__)


_add(
    KeyMap(
        dataset="fractal20220817_data",
        embodiment="google_robot_rt1",
        cameras={"primary": "observation/image"},
        language=NLI,
        control_hz=3,
        action_space="eef_delta",
        state=(raw("observation/base_pose_tool_reached"), raw("observation/gripper_closed")),
        action=(raw(WV), raw(RD), raw(GCA, 0, "rel2abs")),
        features={
            "observation/base_pose_tool_reached": "float32[7]",
            "observation/gripper_closed": "float32[1]",
            **RTX_ACTION,
            GCA: "float32[1]",
            NLI: "string",
        },
        notes="RT-1. terminate_episode and base_displacement_* ignored; state gripper_closed is 1 = closed.",
        sources=(f"{OXE_SOURCE}: fractal20220817_data", REL2ABS_SOURCE),
    )
)

_add(
    KeyMap(
        dataset="kuka",
        embodiment="kuka_iiwa",
        cameras={"primary": "observation/image"},
        language=NLI,
        control_hz=10,
        action_space="eef_delta",
        state=(
            raw("observation/clip_function_input/base_pose_tool_reached"),
            raw("observation/gripper_closed"),
        ),
        action=(raw(WV), raw(RD), raw(GCA, 0, "rel2abs")),
        features={
            "observation/clip_function_input/base_pose_tool_reached": "zlib:float32[7]",
            "observation/gripper_closed": "zlib:float32[1]",
            **RTX_ACTION,
            GCA: "float32[1]",
            NLI: "string",
        },
        notes="Both state fields are ZLIB-compressed float32 bytes per step (decompressed here). Octo blanks the "
        "language; kept here (OpenVLA).",
        sources=(f"{OXE_SOURCE}: kuka",),
    )
)

_add(
    KeyMap(
        dataset="bridge_dataset",
        aliases=("bridge_orig",),
        embodiment="widowx_bridge",
        cameras={"primary": "observation/image_0", "secondary": "observation/image_1"},
        language=LI,
        control_hz=5,
        action_space="eef_delta",
        state=(raw("observation/state", slice(0, 7)),),
        action=(raw("action", slice(0, 6)), raw("action", 6, "binarize")),
        steps=("state_delta_relabel",),
        drop_first=1,
        features={"observation/state": "float32[7]", "action": "float32[7]", LI: "string"},
        notes="RAIL BridgeData V2 (Octo name bridge_dataset, OpenVLA bridge_orig). Movement dims relabelled as the "
        "state difference (drops the last frame); gripper binarized. drop_first=1 follows OpenVLA: the raw first "
        "action is all-zero movement (checked on the fixture); Octo keeps it -> StandardizeOptions(drop_first=0). "
        "image_2/image_3 are not used (OpenVLA/Octo use image_0 and image_1 only).",
        sources=(
            f"{OXE_SOURCE}: bridge_orig/bridge_dataset",
            "octo-models/octo's bridge_dataset 1.0.0 debug copy (decoded: first action all-zero)",
        ),
    )
)

_add(
    KeyMap(
        dataset="bridge",
        aliases=("bridge_oxe",),
        embodiment="widowx_bridge",
        cameras={"primary": "observation/image"},
        language=NLI,
        control_hz=5,
        action_space="eef_delta",
        state=(raw("observation/state", slice(0, 7)),),
        action=(raw(WV), raw(RD), raw(OG, 0)),
        steps=("state_delta_relabel",),
        drop_first=1,
        features={"observation/state": "float32[7]", **RTX_ACTION, OG: "bool", NLI: "string"},
        notes="The GCS OXE copy of Bridge in the RT-X layout (OpenVLA bridge_oxe; out of date per the OpenVLA README, "
        "prefer bridge_orig). open_gripper is 1 = open. Same relabel and first-step drop as bridge_dataset. Only "
        "`image` exists in this layout (OpenVLA's config also names image_1).",
        sources=(f"{OXE_SOURCE}: bridge_oxe",),
    )
)

_add(
    KeyMap(
        dataset="jaco_play",
        embodiment="jaco_play",
        cameras={"primary": "observation/image", "wrist": "observation/image_wrist"},
        language=NLI,
        control_hz=10,
        action_space="eef_delta",
        state=(raw("observation/end_effector_cartesian_pos"),),
        action=(raw(WV), raw(GCA, 0, "rel2abs")),
        features={
            "observation/end_effector_cartesian_pos": "float32[7]",
            WV: "float32[3]",
            GCA: "float32[1]",
            NLI: "string",
        },
        notes="No rotation command in the data: 4-D action (OpenVLA/Octo pad three zeros). State is xyz + quaternion "
        "(CLVR README).",
        sources=(f"{OXE_SOURCE}: jaco_play", "CLVR jaco_play README"),
    )
)

_add(
    KeyMap(
        dataset="roboturk",
        embodiment="sawyer_roboturk",
        cameras={"primary": "observation/front_rgb"},
        language=NLI,
        control_hz=10,
        action_space="eef_delta",
        state=(zeros(1),),
        action=(raw(WV), raw(RD), raw(GCA, 0, "clip_invert")),
        features={**RTX_ACTION, GCA: "float32[1]", NLI: "string"},
        notes="No proprio in the data: one documented zero (as Octo), flagged invalid. Octo blanks the language; "
        "kept here.",
        sources=(f"{OXE_SOURCE}: roboturk",),
    )
)

_add(
    KeyMap(
        dataset="nyu_door_opening_surprising_effectiveness",
        embodiment="stretch_oxe_eef",
        cameras={"wrist": "observation/image"},
        language=NLI,
        control_hz=3,
        action_space="eef_delta",
        state=(zeros(7),),
        action=(raw(WV), raw(RD), raw(GCA, 0, "rel2abs")),
        features={**RTX_ACTION, GCA: "float32[1]", NLI: "string"},
        notes="Wrist camera only (why OpenVLA leaves it out of its soup); no proprio: 7 documented zeros, flagged "
        "invalid in metadata['state_valid']. Octo blanks the language; kept here.",
        sources=(f"{OXE_SOURCE}: nyu_door_opening_surprising_effectiveness",),
    )
)

_add(
    KeyMap(
        dataset="berkeley_autolab_ur5",
        embodiment="ur5_autolab",
        cameras={"primary": "observation/image", "wrist": "observation/hand_image"},
        language=NLI,
        control_hz=5,
        action_space="eef_delta",
        state=(raw("observation/robot_state", slice(6, 14)),),
        action=(raw(WV), raw(RD), raw(GCA, 0, "rel2abs")),
        features={"observation/robot_state": "float32[15]", **RTX_ACTION, GCA: "float32", NLI: "string"},
        notes="robot_state[6:14] = EE xyz + quaternion + gripper (OpenVLA/Octo). gripper_closedness_action is a scalar "
        "per step (TFDS: 1 close, -1 open, 0 no change).",
        sources=(f"{OXE_SOURCE}: berkeley_autolab_ur5",),
    )
)

_add(
    KeyMap(
        dataset="language_table",
        embodiment="xarm_language_table",
        cameras={"primary": "observation/rgb"},
        language="observation/instruction",
        control_hz=10,
        action_space="eef_xy_delta",
        state=(raw("observation/effector_translation"),),
        action=(raw("action"),),
        features={
            "observation/effector_translation": "float32[2]",
            "action": "float32[2]",
            "observation/instruction": "int32[512]",
        },
        notes="Instruction is int32 Unicode code points, NUL-padded (decoded, cut at the first NUL). Planar 2-D action; "
        "OpenVLA/Octo pad to 7-D with a constant gripper 1, not needed with a per-embodiment head.",
        sources=(f"{OXE_SOURCE}: language_table",),
    )
)

_add(
    KeyMap(
        dataset="ucsd_kitchen_dataset_converted_externally_to_rlds",
        embodiment="xarm_oxe_joint",
        cameras={"primary": "observation/image"},
        language=LI,
        control_hz=2,
        action_space="eef_delta",
        state=(raw("observation/state", slice(0, 7)),),
        action=(raw("action", slice(0, 7)),),
        features={"observation/state": "float32[21]", "action": "float32[8]", LI: "string"},
        notes="Last action dim (terminate) dropped; absolute vs delta and the gripper convention are unverified "
        "(passed through as in OpenVLA/Octo).",
        sources=(f"{OXE_SOURCE}: ucsd_kitchen",),
    )
)

_add(
    KeyMap(
        dataset="bc_z",
        embodiment="google_robot_bcz",
        cameras={"primary": "observation/image"},
        language=NLI,
        control_hz=10,
        action_space="eef_delta",
        state=(
            raw("observation/present/xyz"),
            raw("observation/present/axis_angle"),
            raw("observation/present/sensed_close"),
        ),
        action=(
            raw("action/future/xyz_residual", slice(0, 3)),
            raw("action/future/axis_angle_residual", slice(0, 3)),
            raw("action/future/target_close", 0, "invert"),
        ),
        features={
            "observation/present/xyz": "float32[3]",
            "observation/present/axis_angle": "float32[3]",
            "observation/present/sensed_close": "float32[1]",
            "action/future/xyz_residual": "float32[30]",
            "action/future/axis_angle_residual": "float32[30]",
            "action/future/target_close": "float32[10]",
            NLI: "string",
        },
        notes="Rotations are axis-angle. Only the first of the 10 future steps is used. OpenVLA: use v0.1.0 only.",
        sources=(f"{OXE_SOURCE}: bc_z",),
    )
)

_add(
    KeyMap(
        dataset="dlr_edan_shared_control_converted_externally_to_rlds",
        embodiment="dlr_edan",
        cameras={"primary": "observation/image"},
        language=LI,
        control_hz=5,
        action_space="eef_delta",
        state=(raw("observation/state"),),
        action=(raw("action", slice(0, 6)), raw("action", 6, "invert")),
        features={"observation/state": "float32[7]", "action": "float32[7]", LI: "string"},
        sources=(f"{OXE_SOURCE}: dlr_edan_shared_control",),
    )
)

_add(
    KeyMap(
        dataset="berkeley_fanuc_manipulation",
        embodiment="fanuc_mate_oxe",
        cameras={"primary": "observation/image", "wrist": "observation/wrist_image"},
        language=LI,
        control_hz=10,
        action_space="eef_delta",
        state=(raw("observation/state", slice(0, 7)),),
        action=(raw("action"), raw("observation/state", 6, "invert")),
        features={"observation/state": "float32[13]", "action": "float32[6]", LI: "string"},
        notes="No gripper action in the data: the target is 1 - state[6] of the same step (OpenVLA/Octo).",
        sources=(f"{OXE_SOURCE}: berkeley_fanuc_manipulation",),
    )
)

_add(
    KeyMap(
        dataset="cmu_stretch",
        embodiment="stretch_oxe_eef",
        cameras={"primary": "observation/image"},
        language=LI,
        control_hz=10,
        action_space="eef_delta",
        state=(raw("observation/state", slice(0, 3)), zeros(3), raw("observation/state", 3)),
        action=(raw("action", slice(0, 7)),),
        features={"observation/state": "float32[4]", "action": "float32[8]", LI: "string"},
        notes="No orientation in the state (3 documented zeros). Last action dim dropped; gripper passed through "
        "(convention unverified).",
        sources=(f"{OXE_SOURCE}: cmu_stretch",),
    )
)

_add(
    KeyMap(
        dataset="dobbe",
        embodiment="stretch_oxe_eef",
        cameras={"wrist": "observation/wrist_image"},
        language=LI,
        control_hz=3.75,
        action_space="eef_delta",
        state=(raw("observation/state"),),
        action=(raw("action"),),
        features={"observation/state": "float32[7]", "action": "float32[7]", LI: "string"},
        notes="The only camera is gripper-mounted: slot wrist (Octo; OpenVLA puts it in primary). Gripper passed "
        "through (convention unverified).",
        sources=(f"{OXE_SOURCE}: dobbe",),
    )
)
