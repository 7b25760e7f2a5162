import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The tests never download data (experiments/datasets.py; the scripts run here inherit it).
os.environ["THOR_TF_NO_DOWNLOAD"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "update_rule(name): run the module's models with this thor_tf update rule as "
                   "the default (the tests of THOR's inverse rule: its K-FAC step, KL clip, damping "
                   "and momentum, written before the eigenbasis rule became the default)")
    config.addinivalue_line(
        "markers", "numerics: a float32 result checked against a float64 reference, replicas "
                   "against one device, or a resumed run against an uninterrupted one; .ci/run "
                   "runs these a second time on another kernel path (NUMERICS below; "
                   "docs/internals.md, Tests)")


#: The tests marked ``numerics`` (node ids; a parametrized test by its name takes every case, or
#: one case by its id): those whose tolerance is float32 round-off, so that they fail when a
#: tolerance holds only on the kernels of one CPU. Chosen by what they assert and by CI's time
#: (the second pass took 190 s with -n 2 on 2 cores other jobs shared, load ~5; `python -m
#: pytest -m numerics tests` runs them).
NUMERICS = (
    # The update rules' steps against float64 first principles, and the pieces they are made of.
    "tests/test_eigenbasis.py::test_dense_steps_match_float64_first_principles",
    "tests/test_eigenbasis.py::test_other_blocks_replay_the_float64_rule",
    "tests/test_eigenbasis.py::test_growing_beta_2_matches_float64_first_principles",
    "tests/test_eigenbasis.py::test_growing_beta_2_is_adafactors_decay_on_every_variable",
    "tests/test_eigenbasis.py::test_beta_1_following_the_rate_matches_float64_first_principles",
    "tests/test_eigenbasis.py::test_relative_epsilon_following_the_rate_matches_float64_first_principles",
    "tests/test_eigenbasis_orthogonal.py::test_dense_orthogonal_steps_match_float64_first_principles",
    "tests/test_eigenbasis_orthogonal.py::test_neuron_normalized_steps_match_float64_first_principles",
    "tests/test_eigenbasis_orthogonal.py::test_fewer_newton_schulz_steps_match_float64_first_principles",
    "tests/test_eigenbasis_orthogonal.py::test_newton_schulz_steps_following_the_rate_match_float64_first_principles",
    "tests/test_eigenbasis_fast_step.py::test_rotations_match_dense_block_diagonal_products",
    "tests/test_eigenbasis_fast_step.py::test_stacked_moment_carry_against_float64_and_the_blocks_it_must_keep",
    "tests/test_eigenbasis_fast_step.py::test_many_tensors_at_once_are_each_their_own_iteration",
    "tests/test_newton_schulz.py::test_within_a_small_multiple_of_the_float32_iterations_error",
    "tests/test_newton_schulz.py::test_a_batch_is_each_matrix_alone",
    "tests/test_eigenbasis_diagonal.py::test_diagonal_sides_match_float64_first_principles",
    "tests/test_eigenbasis_power_refresh.py::test_power_step_moves_a_near_basis_to_the_float64_eigenvectors",
    "tests/test_eigenbasis_power_refresh.py::test_off_diagonal_ratio_against_float64",
    "tests/test_eigenbasis_power_refresh.py::test_first_refresh_and_a_failed_check_fall_back_to_float64_eigh",
    "tests/test_blocks.py::test_dense_factors_match_reference",
    "tests/test_blocks.py::test_preconditioned_update_matches_reference",
    "tests/test_block_diagonal.py::test_training_products_equal_the_block_diagonal_mat_algebra_bitwise",
    "tests/test_conv_factor.py::test_shifted_factor_matches_explicit_patches",
    "tests/test_inverse_ops.py::test_preconditioned_gradients_equal_the_explicit_kronecker_product",
    "tests/test_loss_scale.py::test_step_under_a_loss_weight_matches_the_float64_formula",
    "tests/test_reliability.py::test_mixed_float16_factors_equal_the_float64_reference",
    # Replicas against one device under the default rule, and resumed runs.
    # (its kernel paths inherit the pass's environment: under .ci/run's AVX2 cap, [onednn_off] is
    # the AMD EPYC's path; test_replicas_take_the_single_device_step's 5e-3 is 60x its errors)
    "tests/test_distribute.py::test_replicas_with_a_refresh_at_every_step_differ_as_one_device_reordered",
    "tests/test_eigenbasis.py::test_save_and_load_resume_the_same_run",
)
# Left out for CI's time (~120 s of test time under load, a third of the pass), each with a
# cheaper test above of the same maths: test_blocks.py's Conv2D factors (test_conv_factor.py's
# explicit patches), test_lora.py's first principles (the same Dense / EinsumDense factors and
# step), test_reliability.py's BackupAndRestore (a resumed run: test_save_and_load_resume_the_same_run),
# and test_distribute.py's two-replica checkpoint test (~35 s, the pass's longest: its bound is
# max(SAME_STEP, 2x what the uninterrupted 2-replica run reaches on the pass's own kernels), so
# it adapts to the path; resumed runs on this path are test_save_and_load_resume_the_same_run's,
# replicas on it test_replicas_with_a_refresh_at_every_step_...'s).


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in NUMERICS or item.nodeid.split("[")[0] in NUMERICS:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture(autouse=True)
def _default_update_rule(request, monkeypatch):
    marker = request.node.get_closest_marker("update_rule")
    if marker is not None:
        import thor_tf.rules

        monkeypatch.setattr(thor_tf.rules, "DEFAULT_RULE", marker.args[0])
