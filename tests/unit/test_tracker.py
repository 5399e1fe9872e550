import torch

from memfit.memory import Monitor, StorageTracker, snapshot


def test_counts_parameters_inputs_and_frees_exactly() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
    param_bytes = (100 * 100 + 100 + 100 * 10 + 10) * 4
    with StorageTracker() as tracker:
        tracker.track_module(model)
        assert tracker.live_bytes == param_bytes
        x = torch.randn(32, 100)
        tracker.track(x)
        model(x).sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert tracker.live_bytes == 2 * param_bytes + x.nbytes  # graph freed, grads kept
        del grads
        for p in model.parameters():
            p.grad = None
        assert tracker.live_bytes == param_bytes + x.nbytes
        assert tracker.peak_bytes > 2 * param_bytes + x.nbytes


def test_views_share_their_storage() -> None:
    with StorageTracker() as tracker:
        base = torch.zeros(1024)
        before = tracker.live_bytes
        view = base[10:20].view(2, 5)
        view.add_(1)
        transposed = view.t()
        assert tracker.live_bytes == before == 4096
        del view, transposed


def test_round_to_emulates_block_allocator() -> None:
    with StorageTracker(round_to=512) as tracker:
        a = torch.zeros(3)  # 12 bytes -> one 512-byte block
        assert tracker.live_bytes == 512
        del a
        assert tracker.live_bytes == 0


def test_phase_peaks_are_the_max_inside_each_phase() -> None:
    with StorageTracker() as tracker:
        with tracker.phase("forward"):
            big = torch.zeros(1000)  # 4000 bytes
            del big
        with tracker.phase("optimizer"):
            small = torch.zeros(10)
            del small
        assert tracker.phase_peaks == {"forward": 4000, "optimizer": 40}
        assert tracker.peak_bytes == 4000


def test_monitor_snapshot_reports_active_monitor_on_cpu() -> None:
    with Monitor.for_device("cpu") as monitor:
        keep = torch.zeros(256)
        monitor.track(keep)
        current = snapshot()
        assert current.current_bytes == 1024
        assert current.rss_bytes is not None and current.rss_bytes > 0
        with monitor.phase("forward"):
            temporary = torch.ones(512)
            del temporary
        assert monitor.snapshot().phase_peaks["forward"] == 1024 + 2048


def test_a_storage_written_as_out_and_resized_in_place_is_freed_and_counted_again() -> None:
    """FSDP2 frees a gathered parameter with ``storage.resize_(0)`` and makes it again with ``resize_(n)``, on the
    same storage object, between the ops that write into it (``out=``): no op says so, the tracker sees it."""
    with StorageTracker() as tracker:
        gathered = torch.empty(256)
        ones = torch.ones(256)
        torch.add(ones, ones, out=gathered)  # FSDP2's copy-out writes the all-gather into it
        assert tracker.live_bytes == 2 * 1024
        gathered.untyped_storage().resize_(0)  # after the block's forward
        small = torch.zeros(1)  # the next op sees it freed before it allocates
        assert tracker.live_bytes == 1024 + 4 and tracker.peak_bytes == 2 * 1024
        gathered.untyped_storage().resize_(1024)  # before the next all-gather
        torch.add(ones, ones, out=gathered)
        assert tracker.live_bytes == tracker.peak_bytes == 2 * 1024 + 4
        assert tracker.category_bytes["temporaries"] == 2 * 1024 + 4
        gathered.untyped_storage().resize_(0)
        with tracker.phase("forward"):  # freed before the phase starts: not in its peak
            assert tracker.live_bytes == tracker.phase_peaks["forward"] == 1024 + 4
            gathered.untyped_storage().resize_(1024)
            view = gathered.view(16, 16)  # FSDP2 views the storage before its copy-out writes into it
            assert tracker.live_bytes == 2 * 1024 + 4
            assert tracker.category_bytes["temporaries"] == 2 * 1024 + 4  # its category, not the phase's
        del gathered, small, view
        assert tracker.live_bytes == 1024
