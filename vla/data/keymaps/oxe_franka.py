"""Open X-Embodiment key maps, Franka Panda datasets (DROID: ``droid.py``; other robots: ``oxe.py``).

All share the OXE EEF_POS action (delta xyz + delta rpy + gripper 1 = open). The state goes to one of two
layouts, chosen by what the dataset records: ``franka_oxe_eef`` (EE xyz + Euler rpy + gripper reading;
quaternion poses converted to Euler) or ``franka_oxe_joint`` (7 joint angles + gripper reading). A missing
gripper reading is a documented zero, flagged in ``StdEpisode.metadata["state_valid"]``. Facts:
OpenVLA's and Octo's per-dataset configs and transforms (``OXE_SOURCE``). Language is kept where Octo blanks it (OpenVLA behaviour).
"""

from __future__ import annotations

from vla.data.keymaps import OXE_SOURCE, KeyMap, raw, register, zeros
from vla.data.keymaps.oxe import GCA, LI, NLI, OG, RD, RTX_ACTION, WV


def _add(km: KeyMap) -> None:
    register(km, __name__)


STATE, ACTION = "observation/state", "action"
IMAGE, WRIST = "observation/image", "observation/wrist_image"
# Flat 7-D actions ordered (dxyz, drpy, gripper), the most common "converted externally" layout.
EEF7_CLIP_INVERT = (raw(ACTION, slice(0, 6)), raw(ACTION, 6, "clip_invert"))

# ---- EE-pose proprio: franka_oxe_eef ----------------------------------------------------------------------------

_add(
    KeyMap(
        dataset="taco_play",
        embodiment="franka_oxe_eef",
        cameras={"primary": "observation/rgb_static", "wrist": "observation/rgb_gripper"},
        language=NLI,
        control_hz=15,
        action_space="eef_delta",
        state=(raw("observation/robot_obs", slice(0, 6)), raw("observation/robot_obs", 6)),
        action=(raw("action/rel_actions_world", slice(0, 6)), raw("action/rel_actions_world", 6, "clip")),
        features={
            "observation/robot_obs": "float32[15]",
            "action/rel_actions_world": "float32[7]",
            NLI: "string",
        },
        notes="Gripper state = robot_obs[6], the gripper width per the TFDS description (OpenVLA/Octo take index 7, "
        "joint 1: an off-by-one). Gripper action +1 open / -1 close (CALVIN) -> clip gives 1 = open; the TFDS text "
        "says the opposite.",
        sources=(f"{OXE_SOURCE}: taco_play", "tensorflow.org/datasets/catalog/taco_play"),
    )
)

_add(
    KeyMap(
        dataset="stanford_hydra_dataset_converted_externally_to_rlds",
        embodiment="franka_oxe_eef",
        cameras={"primary": IMAGE, "wrist": WRIST},
        language=LI,
        control_hz=10,
        action_space="eef_delta",
        state=(raw(STATE, slice(0, 3)), raw(STATE, slice(7, 10)), raw(STATE, 24)),
        action=(raw(ACTION, slice(0, 6)), raw(ACTION, 6, "invert")),
        features={STATE: "float32[27]", ACTION: "float32[7]", LI: "string"},
        notes="state: xyz(0:3), quat(3:7), euler(7:10), joints, joint vel, gripper(24:27); uses xyz, euler, gripper[24].",
        sources=(f"{OXE_SOURCE}: stanford_hydra",),
    )
)

_add(
    KeyMap(
        dataset="nyu_franka_play_dataset_converted_externally_to_rlds",
        embodiment="franka_oxe_eef",
        cameras={"primary": IMAGE, "secondary": "observation/image_additional_view"},
        language=LI,
        control_hz=3,
        action_space="eef_delta",
        state=(raw(STATE, slice(7, 13)), zeros(1)),
        action=(raw(ACTION, slice(7, 13)), raw(ACTION, 13, "clip")),
        features={STATE: "float32[13]", ACTION: "float32[15]", LI: "string"},
        notes="state[7:13] = EE xyz + rpy; no gripper reading (documented zero). action = [7 joint vel, EE delta xyz, "
        "EE delta rpy, gripper, terminate]: uses [7:13] and clip([13]).",
        sources=(f"{OXE_SOURCE}: nyu_franka_play", "TFDS catalog (state 13, action 15)"),
    )
)

_add(
    KeyMap(
        dataset="furniture_bench_dataset_converted_externally_to_rlds",
        embodiment="franka_oxe_eef",
        cameras={"primary": IMAGE, "wrist": WRIST},
        language=LI,
        control_hz=10,
        action_space="eef_delta",
        state=(raw(STATE, slice(0, 3)), raw(STATE, slice(3, 7), "quat_to_euler"), raw(STATE, 34)),
        action=(
            raw(ACTION, slice(0, 3)),
            raw(ACTION, slice(3, 7), "quat_to_euler"),
            raw(ACTION, 7, "clip_invert"),
        ),
        features={STATE: "float32[35]", ACTION: "float32[8]", LI: "string"},
        notes="Quaternions (xyzw) converted to Euler for state and action (OpenVLA/Octo do it for the action). "
        "state[-1] is the gripper width.",
        sources=(f"{OXE_SOURCE}: furniture_bench",),
    )
)

for _name, _hz in (
    ("austin_sailor_dataset_converted_externally_to_rlds", 20),
    ("austin_sirius_dataset_converted_externally_to_rlds", 20),
):
    _add(
        KeyMap(
            dataset=_name,
            embodiment="franka_oxe_eef",
            cameras={"primary": IMAGE, "wrist": WRIST},
            language=LI,
            control_hz=_hz,
            action_space="eef_delta",
            state=(raw(STATE, slice(0, 3)), raw(STATE, slice(3, 7), "quat_to_euler"), raw(STATE, 7)),
            action=EEF7_CLIP_INVERT,
            features={STATE: "float32[8]", ACTION: "float32[7]", LI: "string"},
            notes="state = EE xyz + quaternion (xyzw assumed; converted to Euler) + gripper. Octo blanks the language.",
            sources=(f"{OXE_SOURCE}: austin_sailor/austin_sirius", "TFDS catalog (state 8)"),
        )
    )

_add(
    KeyMap(
        dataset="fmb_dataset",
        aliases=("fmb",),
        embodiment="franka_oxe_eef",
        cameras={
            "primary": "observation/image_side_1",
            "secondary": "observation/image_side_2",
            "wrist": "observation/image_wrist_1",
        },
        language=LI,
        control_hz=10,
        action_space="eef_delta",
        state=(
            raw("observation/eef_pose", slice(0, 3)),
            raw("observation/eef_pose", slice(3, 7), "quat_to_euler"),
            raw("observation/state_gripper_pose"),
        ),
        action=(raw(ACTION),),
        features={
            "observation/eef_pose": "float32[7]",
            "observation/state_gripper_pose": "float32[1]",
            ACTION: "float32[7]",
            LI: "string",
        },
        notes="eef_pose width and quaternion order unverified (7 = xyz + xyzw assumed). Action passed through "
        "(gripper convention unverified).",
        sources=(f"{OXE_SOURCE}: fmb_dataset",),
    )
)

# ---- joint-angle proprio: franka_oxe_joint ----------------------------------------------------------------------

_add(
    KeyMap(
        dataset="berkeley_cable_routing",
        embodiment="franka_oxe_joint",
        cameras={
            "primary": IMAGE,
            "secondary": "observation/top_image",
            "wrist": "observation/wrist45_image",
        },
        language=NLI,
        control_hz=10,
        action_space="eef_delta",
        state=(raw("observation/robot_state"), zeros(1)),
        action=(raw(WV), raw(RD), zeros(1)),
        features={"observation/robot_state": "float32[7]", **RTX_ACTION, NLI: "string"},
        notes="The gripper holds the cable throughout: constant action 0 (closed); no gripper reading (documented "
        "zero). Octo blanks the language; kept here.",
        sources=(f"{OXE_SOURCE}: berkeley_cable_routing",),
    )
)

_add(
    KeyMap(
        dataset="viola",
        embodiment="franka_oxe_joint",
        cameras={"primary": "observation/agentview_rgb", "wrist": "observation/eye_in_hand_rgb"},
        language=NLI,
        control_hz=20,
        action_space="eef_delta",
        state=(raw("observation/joint_states"), raw("observation/gripper_states")),
        action=(raw(WV), raw(RD), raw(GCA, 0, "clip_invert")),
        features={
            "observation/joint_states": "float32[7]",
            "observation/gripper_states": "float32[1]",
            **RTX_ACTION,
            GCA: "float32",
            NLI: "string",
        },
        notes="gripper_states is the gripper width (0 = fully closed). gripper_closedness_action is a scalar per step.",
        sources=(f"{OXE_SOURCE}: viola", "viola features.json (gripper_states width 1)"),
    )
)

_add(
    KeyMap(
        dataset="toto",
        embodiment="franka_oxe_joint",
        cameras={"primary": IMAGE},
        language=NLI,
        control_hz=30,
        action_space="eef_delta",
        state=(raw(STATE), zeros(1)),
        action=(raw(WV), raw(RD), raw(OG)),
        features={STATE: "float32[7]", **RTX_ACTION, OG: "bool", NLI: "string"},
        notes="state = 7 joint angles, no gripper reading (documented zero); open_gripper is 1 = open.",
        sources=(f"{OXE_SOURCE}: toto", "TFDS catalog toto"),
    )
)

for _name in ("austin_buds_dataset_converted_externally_to_rlds", "utaustin_mutex"):
    _add(
        KeyMap(
            dataset=_name,
            embodiment="franka_oxe_joint",
            cameras={"primary": IMAGE, "wrist": WRIST},
            language=LI,
            control_hz=20,
            action_space="eef_delta",
            state=(raw(STATE, slice(0, 8)),),
            action=EEF7_CLIP_INVERT,
            features={STATE: "float32[24]", ACTION: "float32[7]", LI: "string"},
            notes="state = 7 joints + gripper + 16-D EE matrix; uses [0:8]. Gripper action -1..1 with +1 = close.",
            sources=(f"{OXE_SOURCE}: austin_buds/utaustin_mutex",),
        )
    )

_add(
    KeyMap(
        dataset="iamlab_cmu_pickup_insert_converted_externally_to_rlds",
        embodiment="franka_oxe_joint",
        cameras={"primary": IMAGE, "wrist": WRIST},
        language=LI,
        control_hz=20,
        action_space="eef_delta",
        state=(raw(STATE, slice(0, 8)),),
        action=(raw(ACTION, slice(0, 3)), raw(ACTION, slice(3, 7), "quat_to_euler"), raw(ACTION, 7)),
        features={STATE: "float32[20]", ACTION: "float32[8]", LI: "string"},
        notes="Action quaternion (xyzw) converted to Euler; gripper passed through (convention unverified).",
        sources=(f"{OXE_SOURCE}: iamlab_cmu_pickup_insert",),
    )
)
