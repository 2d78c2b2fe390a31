"""sketch-dp: privacy accounting against Opacus, noise and clipping, the sketch algebra over real
sockets, a shared R_t, sample-level DP, the leakage attack, and refused privacy parameters."""
from __future__ import annotations

import copy
import io
import json
import math

import pytest
import torch
from conftest import in_parallel, opacus_accountants, swarm

from starling.compressors import rng
from starling.protocols import ProtocolError, get_protocol
from starling.protocols.leakage import reconstruct_sample
from starling.protocols.privacy import Accountant, PrivateData, clip_rows_, per_sample_grads
from starling.protocols.sketch_dp import SketchDPConfig, SketchMap
from starling.tasks import get_task

TEACHER = get_task("teacher")
QUICK = {"round_timeout_s": 10.0}


def create(node, options, model=None):
    return get_protocol("sketch-dp").create(node, model or TEACHER.make_model(), {**QUICK, **options})


def train(protos, steps: int, world: int | None = None):
    """Every peer steps `steps` times on its own teacher shard, in parallel; returns reports."""
    world = world or len(protos)

    def run(rank: int):
        batches = TEACHER.batches(rank, world, seed=0)
        out = []
        for _ in range(steps):
            batch = next(batches)
            out.append(protos[rank].step(lambda: TEACHER.loss(protos[rank].model, batch)))
        return out

    return in_parallel([lambda r=r: run(r) for r in range(len(protos))])


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---------------------------------------------------------------- refused parameters
@pytest.mark.parametrize("options, message", [
    ({"target_epsilon": 0.0, "budget_steps": 10}, "target_epsilon must be > 0"),
    ({"target_epsilon": -2.0, "budget_steps": 10}, "target_epsilon must be > 0"),
    ({"delta": 1.0}, "delta must be in"),
    ({"delta": 1.5}, "delta must be in"),
    ({"delta": 0.0}, "delta must be in"),
    ({"clip": 0.0}, "clip must be > 0"),
    ({"clip": -1.0}, "clip must be > 0"),
    ({"noise_multiplier": -0.5}, "noise_multiplier must be >= 0"),
    ({"noise_multiplier": 1.0, "target_epsilon": 1.0, "budget_steps": 10}, "not both"),
    ({"target_epsilon": 1.0}, "budget_steps"),
    ({"clip": "inf", "noise_multiplier": 1.0}, "clip must be finite"),
    ({"dp_unit": "user"}, "dp_unit"),
    ({"accountant": "gdp"}, "accountant"),
    ({"sample_rate": 0.0}, "sample_rate"),
    ({"sketch": "topk:0.1"}, "sketch must be"),
    ({"sketch": "gsketch:0"}, "size"),
])
def test_invalid_privacy_parameters_are_refused(make_node, options, message):
    with pytest.raises(ProtocolError, match=message):
        create(make_node("inproc"), options)


def test_the_config_itself_refuses_them_with_value_errors():
    for bad in ({"target_epsilon": 0.0, "budget_steps": 5}, {"delta": 1.0}, {"clip": 0.0}):
        with pytest.raises(ValueError):
            SketchDPConfig(**bad)


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # sigma far past any order we try
def test_an_unreachable_budget_is_refused(make_node):
    with pytest.raises(ProtocolError, match="cannot reach epsilon"):
        create(make_node("inproc"), {"target_epsilon": 1e-9, "budget_steps": 10**6, "delta": 1e-12})


# ---------------------------------------------------------------- accounting
def test_rdp_looks_past_opacus_default_orders_where_the_bound_is_tighter_there():
    """With much noise and few rounds the best RDP order lies past Opacus' default 63: the
    same release then costs a third of the epsilon Opacus' defaults report. Where the best
    order is inside that range both agree."""
    ours, theirs = Accountant("rdp"), opacus_accountants().RDPAccountant()
    for _ in range(10):
        ours.step(5.0, 0.01)
    theirs.history = [(5.0, 0.01, 10)]
    with pytest.warns(UserWarning, match="largest alpha"):
        default = theirs.get_epsilon(delta=1e-5)
    assert ours.epsilon(1e-5) < default / 3


@pytest.mark.parametrize("mechanism, opacus_class, steps", [("rdp", "RDPAccountant", 60), ("prv", "PRVAccountant", 12)])
def test_reported_epsilon_equals_opacus_for_the_same_sigma_q_steps(mechanism, opacus_class, steps):
    ours, theirs = Accountant(mechanism), getattr(opacus_accountants(), opacus_class)()
    for _ in range(steps):
        ours.step(1.1, 0.02)
        theirs.step(noise_multiplier=1.1, sample_rate=0.02)
    assert ours.history == theirs.history
    assert ours.epsilon(1e-5) == pytest.approx(theirs.get_epsilon(delta=1e-5), rel=1e-9)


def test_the_protocol_reports_opacus_epsilon_after_every_round(make_node):
    proto = create(make_node("inproc"), {"noise_multiplier": 1.3, "clip": 0.5})
    batches = TEACHER.batches(0, 1, seed=0)
    reference = opacus_accountants().RDPAccountant()
    for _ in range(3):
        batch = next(batches)
        proto.step(lambda: TEACHER.loss(proto.model, batch))
        reference.step(noise_multiplier=1.3, sample_rate=1.0)
        assert proto.privacy.epsilon == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9)
    assert proto.privacy.rounds == 3 and proto.privacy.dp_unit == "peer" and proto.privacy.sample_rate == 1.0


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # plain Opacus, for the expected sigma
def test_sigma_is_solved_from_a_target_epsilon(make_node):
    options = {"target_epsilon": 4.0, "budget_steps": 40, "dp_unit": "sample", "sample_rate": 0.05}
    proto = create(make_node("inproc"), options)
    expected = opacus_accountants().utils.get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=0.05, steps=40, accountant="rdp")
    assert proto.sigma == pytest.approx(expected)
    for _ in range(40):
        proto.accountant.step(proto.sigma, 0.05)
    assert 3.9 <= proto.privacy.epsilon <= 4.0


def test_without_noise_epsilon_is_infinite_and_describe_says_so(make_node):
    proto = create(make_node("inproc"), {"sketch": "gsketch:50"})
    batch = next(TEACHER.batches(0, 1, seed=0))
    proto.step(lambda: TEACHER.loss(proto.model, batch))
    info = proto.describe()
    assert math.isinf(proto.privacy.epsilon) and info["privacy"]["epsilon"] == "inf"
    assert {"epsilon", "delta", "noise_multiplier", "noise_std", "clip", "dp_unit", "sample_rate",
            "accountant"} <= set(info["privacy"])
    assert info["sketch_size"] == 50 and info["config"]["sketch"] == "gsketch:50"
    json.loads(json.dumps(info))


def test_state_dict_loads_weights_only_and_a_joiner_reports_the_same_epsilon(make_node):
    donor = create(make_node("inproc"), {"noise_multiplier": 0.9, "sketch": "countsketch:3x64,heavy=20"})
    batches = TEACHER.batches(0, 1, seed=0)
    for _ in range(3):
        batch = next(batches)
        donor.step(lambda: TEACHER.loss(donor.model, batch))
    buffer = io.BytesIO()
    torch.save(donor.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    joiner = create(make_node("inproc"), {"noise_multiplier": 0.9, "sketch": "countsketch:3x64,heavy=20"})
    joiner.load_state_dict(state)
    assert joiner.step_count == 3 and joiner.privacy == donor.privacy
    assert torch.equal(joiner.error, donor.error) and torch.equal(flat_params(joiner.model), flat_params(donor.model))


# ---------------------------------------------------------------- noise and clipping
def test_empirical_noise_std_matches_sigma_times_clip(make_node):
    sigma, clip = 1.5, 0.4
    proto = create(make_node("inproc"), {"noise_multiplier": sigma, "clip": clip, "lr": 0.0})
    releases = []
    for _ in range(5):  # a zero gradient: the release is the noise alone
        proto.step(lambda: 0.0 * sum(p.sum() for p in proto.model.parameters()))
        releases.append(proto.last_release)
    noise = torch.cat(releases)
    assert noise.numel() == 5 * 4096
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.03)
    assert abs(noise.mean().item()) < 0.02


@pytest.mark.slow
def test_clipping_bounds_the_sent_norm(make_node):
    clip = 0.05
    protos = [create(n, {"clip": clip, "sketch": "gsketch:64"}) for n in swarm(make_node, 3)]
    for reports in train(protos, 2):
        assert all(r.synced for r in reports)
    for proto in protos:
        norm = proto.last_release.norm().item()
        assert clip * 0.999 <= norm <= clip * (1 + 1e-5)  # teacher gradients are far above 0.05: clipped
    rows = torch.randn(5, 10) * torch.tensor([0.1, 1, 10, 100, 1000]).unsqueeze(1)
    clip_rows_(rows, 1.0)
    assert torch.all(rows.norm(dim=1) <= 1.0 + 1e-6)
    assert rows[0].norm() < 1.0  # rows already inside the ball are left alone


# ---------------------------------------------------------------- sketch algebra and R_t
@pytest.mark.parametrize("spec", ["gsketch:32", "gsketch:32,kind=srht", "countsketch:1x32,hash=shift"])
def test_sum_of_sketches_unsketches_to_an_unbiased_estimate_of_the_sum(spec):
    gen = torch.Generator().manual_seed(0)
    updates = torch.randn(3, 200, generator=gen)
    sketches = SketchMap(spec, 200)
    estimates = [sketches.unsketch(sketches.sketch(updates, t).sum(0), t) for t in range(300)]
    mean = torch.stack(estimates).mean(0)
    truth = updates.sum(0)
    assert (mean - truth).norm() / truth.norm() < 0.2  # one estimate is off by ~sqrt(200/32); the mean by ~0.15
    assert (estimates[0] - truth).norm() / truth.norm() > 0.5


@pytest.mark.parametrize("spec", ["countsketch:5x256", "countsketch:5x256,hash=shift"])
def test_sum_of_count_sketches_recovers_planted_heavy_hitters(spec):
    gen = torch.Generator().manual_seed(1)
    updates = torch.randn(3, 5000, generator=gen) * 0.01
    planted = {17: (4.0, 1.0, 0.0), 1000: (-3.0, -3.0, -1.0), 2345: (0.0, 0.0, 6.0), 4999: (2.0, -5.0, 1.0)}
    for index, values in planted.items():
        updates[:, index] = torch.tensor(values)
    sketches = SketchMap(spec, 5000)
    estimate = sketches.unsketch(sketches.sketch(updates, 9).sum(0), 9)
    top = set(torch.topk(estimate.abs(), len(planted)).indices.tolist())
    assert top == set(planted)
    truth = updates.sum(0)
    assert torch.allclose(estimate[list(planted)], truth[list(planted)], atol=0.25)  # tail noise ~0.1


def test_heavy_hitters_apply_top_k_and_accumulate_the_rest(make_node):
    proto = create(make_node("inproc"), {"sketch": "countsketch:3x200,heavy=10"})
    y = torch.randn(600, generator=torch.Generator().manual_seed(2))
    estimate = proto.sketches.unsketch(y, 5)
    update = proto._unsketch(y, 5)
    assert int((update != 0).sum()) == 10
    torch.testing.assert_close(update + proto.error, estimate)  # nothing is lost, only delayed


def test_all_peers_regenerate_the_same_r_t():
    a, b = SketchMap("gsketch:16", 300), SketchMap("gsketch:16", 300)
    x = torch.randn(2, 300)
    seed = rng.derive_seed(7, 3)
    assert torch.equal(a.sketch(x, seed), b.sketch(x, seed))
    assert not torch.equal(a.sketch(x, seed), a.sketch(x, rng.derive_seed(7, 4)))  # fresh every round
    torch.testing.assert_close(a.codec.matrix(300, seed) @ x[0], a.sketch(x, seed)[0])


@pytest.mark.slow
def test_one_round_applies_r_t_transpose_of_the_mean_sketch_and_replicas_agree(make_node):
    world, lr = 3, 0.1
    options = {"sketch": "gsketch:64", "clip": "inf", "lr": lr, "seed": 11}
    protos = [create(n, options) for n in swarm(make_node, world)]
    before = flat_params(protos[0].model)
    batches = [next(TEACHER.batches(r, world, seed=0)) for r in range(world)]
    grads = []
    for r in range(world):
        model = TEACHER.make_model()
        TEACHER.loss(model, batches[r]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    reports = in_parallel([lambda r=r: protos[r].step(lambda: TEACHER.loss(protos[r].model, batches[r]))
                           for r in range(world)])
    assert all(r.synced and r.peers == world for r in reports)
    seed = rng.derive_seed(11, 0)
    sketches = protos[0].sketches
    expected = before - lr * sketches.unsketch(sketches.sketch(torch.stack(grads), seed).mean(0), seed)
    for proto in protos:
        torch.testing.assert_close(flat_params(proto.model), expected, rtol=1e-4, atol=1e-5)
    sizes = 2 * (world - 1) / world * 64 * 4
    assert all(r.bytes_sent < sizes + 2000 for r in reports)  # a sketch's bytes, not the model's (27 KiB)


@pytest.mark.slow
def test_noisy_replicas_stay_identical_and_every_peer_is_accounted(make_node):
    protos = [create(n, {"noise_multiplier": 0.7, "sketch": "countsketch:1x256,hash=shift", "lr": 0.05})
              for n in swarm(make_node, 3)]
    train(protos, 3)
    first = flat_params(protos[0].model)
    assert all(torch.equal(flat_params(p.model), first) for p in protos[1:])  # each adds its own noise;
    assert not torch.equal(protos[0].last_release, protos[1].last_release)  # all decode the same mean
    assert len({p.privacy.epsilon for p in protos}) == 1


# ---------------------------------------------------------------- sample-level DP
def test_per_sample_gradients_match_one_backward_per_sample():
    model = TEACHER.make_model()
    x, y = next(TEACHER.batches(0, 1, seed=0))
    batch = (x[:4], y[:4])
    grads, losses = per_sample_grads(model, TEACHER.loss, batch)
    for i in range(4):
        model.zero_grad()
        loss = TEACHER.loss(model, (x[i : i + 1], y[i : i + 1]))
        loss.backward()
        torch.testing.assert_close(grads[i], torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        assert losses[i].item() == pytest.approx(loss.item(), rel=1e-5)


def test_poisson_batches_are_drawn_at_rate_q():
    data = PrivateData.from_task(TEACHER, 0, 2, 0, size=1000)
    assert data.size == 1000 and data.tensors[0].shape == (1000, 32)
    gen = torch.Generator().manual_seed(3)
    sizes = torch.tensor([data.poisson_batch(0.05, gen)[0].shape[0] for _ in range(400)], dtype=torch.float32)
    assert sizes.mean().item() == pytest.approx(50, abs=2)
    assert sizes.std().item() == pytest.approx(math.sqrt(1000 * 0.05 * 0.95), rel=0.2)  # binomial, not fixed
    with pytest.raises(ValueError, match="one vector"):
        PrivateData.from_task(get_task("quadratic", dim=8), 0, 1, 0, size=10)


@pytest.mark.slow
def test_sample_unit_clips_each_sample_and_accounts_at_rate_q(make_node):
    options = {"dp_unit": "sample", "sample_rate": 0.02, "dataset_size": 800, "noise_multiplier": 1.2,
               "clip": 0.5, "sketch": "gsketch:48"}
    nodes = swarm(make_node, 2)
    protos = [create(n, options) for n in nodes]
    with pytest.raises(ProtocolError, match="attach_task"):
        protos[0].step(lambda: torch.zeros(()))
    for rank, proto in enumerate(protos):
        proto.attach_task(TEACHER, rank, 2, seed=0)
    reports = train(protos, 3)
    assert all(math.isfinite(r.loss) for rs in reports for r in rs)
    reference = opacus_accountants().RDPAccountant()
    for _ in range(3):
        reference.step(noise_multiplier=1.2, sample_rate=0.02)
    for proto in protos:
        assert proto.privacy.dp_unit == "sample" and proto.privacy.sample_rate == 0.02
        assert proto.privacy.epsilon == pytest.approx(reference.get_epsilon(delta=1e-5))
    quiet = create(make_node("inproc"), {**options, "noise_multiplier": 0.0})
    quiet.attach_task(TEACHER, 0, 1, seed=0)
    quiet.step(lambda: torch.zeros(()))
    # the sum of per-sample sketches, each clipped to C, over the expected batch q N
    assert quiet.last_release.norm().item() <= 0.5 * 60 / (0.02 * 800)


# ---------------------------------------------------------------- gradient leakage
@pytest.mark.slow
def test_leakage_attack_recovers_a_sample_without_noise_and_fails_with_it(make_node):
    task = get_task("teacher", hidden=32, depth=1)  # 1386 parameters: the attack's L-BFGS stays quick
    x, label = next(task.batches(0, 1, seed=0))
    sample = (x[:1], label[:1])
    outcome = {}
    for sigma in (0.0, 1.0):
        victim = create(make_node("inproc"), {"sketch": "gsketch:256", "noise_multiplier": sigma, "clip": 1.0},
                        model=task.make_model())
        public_model = copy.deepcopy(victim.model)  # every replica holds the round's parameters
        victim.step(lambda: task.loss(victim.model, sample))  # a peer's update on one sample
        found = reconstruct_sample(public_model, task.loss, victim.last_release, victim.sketches,
                                   rng.derive_seed(victim.config.seed, 0), input_dim=32, num_classes=10,
                                   labels_to_try=1, restarts=1)  # the same effort with and without noise
        outcome[sigma] = (found.relative_error(x[0]), found.label == int(label[0]))
    assert outcome[0.0][0] < 0.05 and outcome[0.0][1], outcome
    assert outcome[1.0][0] > 0.5, outcome


# ---------------------------------------------------------------- CLI
@pytest.mark.slow
def test_starling_simulate_runs_sketch_dp():
    from typer.testing import CliRunner

    from starling.cli.main import app

    result = CliRunner().invoke(app, ["simulate", "--protocol", "sketch-dp", "--opt", "sketch=gsketch:100",
                                      "--opt", "clip=1.0", "--opt", "noise_multiplier=1.0", "--task", "teacher",
                                      "--peers", "2", "--steps", "3", "--json", "--baseline", "none"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["protocol"] == "sketch-dp" and math.isfinite(summary["eval_loss"])


# ---------------------------------------------------------------- distributed noise
def test_distributed_noise_needs_secure_aggregation():
    with pytest.raises(ValueError, match="needs secure_aggregation"):
        SketchDPConfig(noise_multiplier=1.0, dp_noise="distributed")
    with pytest.raises(ValueError, match="dp_noise must be"):
        SketchDPConfig(dp_noise="central")


def test_distributed_noise_reports_the_central_epsilon_and_replicas_agree(make_node):
    """With secure aggregation each peer adds only its share of the noise: the epsilon is
    Opacus' for the full sigma (the sum carries it), and every replica decodes the same mean."""
    options = {"noise_multiplier": 1.2, "sketch": "countsketch:1x256,hash=shift", "lr": 0.05,
               "secure_aggregation": "on", "dp_noise": "distributed"}
    protos = [create(n, options) for n in swarm(make_node, 3)]
    train(protos, 3)
    reference = opacus_accountants().RDPAccountant()
    for _ in range(3):
        reference.step(noise_multiplier=1.2, sample_rate=1.0)
    first = flat_params(protos[0].model)
    assert all(torch.equal(flat_params(p.model), first) for p in protos[1:])
    for p in protos:
        assert p.privacy.epsilon == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9)
        assert p.privacy.noise == "distributed" and p.privacy.rounds == 3


def test_a_lone_member_with_distributed_noise_adds_all_of_it(make_node):
    """Alone, nobody sums its part: a member adds the whole noise itself, and still steps."""
    proto = create(make_node("inproc"), {"noise_multiplier": 1.5, "clip": 0.4, "lr": 0.0,
                                         "secure_aggregation": "on", "dp_noise": "distributed"})
    before = flat_params(proto.model)
    report = proto.step(lambda: 0.0 * sum(p.sum() for p in proto.model.parameters()))
    assert report.step == 0 and proto.privacy.rounds == 1 and torch.equal(flat_params(proto.model), before)
    noise = []
    for _ in range(4):  # lr 0 and a zero gradient: the update is the noise alone
        proto.step(lambda: 0.0 * sum(p.sum() for p in proto.model.parameters()))
        noise.append(proto.flat.gather_grads().clone())
    assert torch.cat(noise).std().item() == pytest.approx(1.5 * 0.4, rel=0.05)
