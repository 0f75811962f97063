"""The reducer, over a recording stand-in for the collective (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from allreduce.reducer import Reducer, UnusedParameterError


class Recorder:
    """Records which buckets start and when; the 'reduction' leaves values as they are."""

    class Done:
        def wait(self):
            pass

    def __init__(self):
        self.started: list[list[float]] = []
        self.during_backward: list[bool] = []
        self.in_backward = False

    def start(self, flat, wire_dtype, name="bucket"):
        self.started.append(flat.clone().tolist())
        self.during_backward.append(self.in_backward)
        return self.Done(), flat.numel() * flat.element_size()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()


def _reducer(model, recorder, **kwargs):
    kwargs.setdefault("cap_mb", 1e-6)
    kwargs.setdefault("first_cap_mb", 1e-6)
    return Reducer(list(model.named_parameters()), recorder, world=1, **kwargs)


def test_buckets_start_during_backward_in_reverse_order():
    model, rec = _model(), Recorder()
    reducer = _reducer(model, rec)
    reducer.prepare()
    # The first parameter's gradient is produced last; mark the end of backward there.
    first = next(model.parameters())
    first.register_hook(lambda g: setattr(rec, "in_backward", False))
    rec.in_backward = True
    model(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
    assert len(rec.started) == 4
    assert rec.during_backward[:3] == [True, True, True]  # overlap: started inside backward
    reducer.finish()
    assert [b.names for b in reducer.buckets] == [["2.bias"], ["2.weight"], ["0.bias"], ["0.weight"]]


def test_grads_are_bucket_views_and_match_plain_backward():
    model, rec = _model(), Recorder()
    reference = _model()
    reducer = _reducer(model, rec, cap_mb=1.0)
    x = torch.randn(5, 4, dtype=torch.float64)
    reducer.prepare()
    model(x).sum().backward()
    reducer.finish()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    # Every .grad lives in its bucket's flat tensor: no copy before or after the all-reduce.
    for bucket in reducer.buckets:
        for p in bucket.params:
            assert p.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
    reducer.zero_grad()
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_unused_parameter_is_named():
    model, rec = _model(), Recorder()
    model.add_module("spare", torch.nn.Linear(2, 2).double())
    reducer = _reducer(model, rec)
    reducer.prepare()
    model[2](model[1](model[0](torch.randn(3, 4, dtype=torch.float64)))).sum().backward()
    with pytest.raises(UnusedParameterError, match="spare.weight.*spare.bias|spare.bias.*spare.weight"):
        reducer.finish()


def test_unused_parameter_reduces_zeros_when_asked():
    model, rec = _model(), Recorder()
    model.add_module("spare", torch.nn.Linear(2, 2).double())
    reducer = _reducer(model, rec, unused="zero")
    reducer.prepare()
    model[2](model[1](model[0](torch.randn(3, 4, dtype=torch.float64)))).sum().backward()
    reducer.finish()
    assert len(rec.started) == 6
    assert torch.count_nonzero(model.spare.weight.grad) == 0


def test_grad_replaced_by_user_is_put_back_into_the_bucket():
    model, rec = _model(), Recorder()
    reducer = _reducer(model, rec, cap_mb=1.0)
    p = next(model.parameters())
    p.grad = torch.ones_like(p)
    reducer.prepare()
    assert p.grad.data_ptr() == reducer._views[p].data_ptr()
    assert torch.equal(p.grad, torch.ones_like(p))
