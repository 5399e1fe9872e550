from pathlib import Path

import torch

from memfit.build import build_model_for, build_optimizer_for, prepare
from memfit.engine import train
from memfit.models import count_parameters
from memfit.techniques.freezing import apply_freezing
from tests.conftest import build_tiny_bert, load_weights, tiny_config


def test_frozen_parameters_stay_bit_identical(tiny_bert: Path, reviews_csv: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_bert, reviews_csv, tmp_path / "run", train_top_layers=1, max_steps=4)
    initial = {name: p.detach().clone() for name, p in build_model_for(prepare(config)).named_parameters()}
    summary = train(config)
    final = load_weights(tmp_path / "run")
    frozen = [name for name in initial if name.startswith(("bert.embeddings", "bert.encoder.layer.0.",
                                                            "bert.encoder.layer.1."))]
    trained = [name for name in initial if name.startswith(("bert.encoder.layer.2.", "classifier"))]
    assert frozen and trained
    for name in frozen:
        assert torch.equal(final[name], initial[name]), name
    assert all(not torch.equal(final[name], initial[name]) for name in trained if name.endswith("weight"))
    assert summary.trainable_parameters < summary.total_parameters
    assert summary.trainable_parameters == sum(initial[name].numel() for name in initial
                                               if not name.startswith(tuple(f.rsplit(".", 1)[0] for f in frozen)))


def test_frozen_parameters_get_no_gradient_and_no_optimizer_state(tiny_bert: Path, reviews_csv: Path,
                                                                 tmp_path: Path) -> None:
    config = tiny_config(tiny_bert, reviews_csv, tmp_path / "run", freeze_embeddings=True)
    prepared = prepare(config)
    model = build_model_for(prepared)
    optimizer = build_optimizer_for(model, config)
    batch = prepared.encoder(prepared.train_examples)(list(range(4)))
    model(**batch).loss.backward()
    optimizer.step()
    embedding_params = list(model.bert.embeddings.parameters())
    assert all(p.grad is None for p in embedding_params)
    assert all(p not in optimizer.state for p in embedding_params)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in embedding_params}
    assert all(len(optimizer.state[p]) > 0 for p in model.bert.encoder.parameters())


def test_train_top_layers_counts() -> None:
    model = build_tiny_bert()
    _, total = count_parameters(model)
    apply_freezing(model, freeze_embeddings=False, train_top_layers=2)
    trainable, _ = count_parameters(model)
    expected = total - sum(p.numel() for p in model.bert.embeddings.parameters()) - sum(
        p.numel() for p in model.bert.encoder.layer[0].parameters())
    assert trainable == expected
