"""Refined key channels (torch_rkv.channels): the refinement's error bound, the ranking file, the scheme's
fields, bits and refusals, the simulation's round trip and the calibration's ranking."""

import pytest
import torch
from conftest import device_params
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import torch_rkv
from torch_rkv import channels
from torch_rkv import reference as ref
from torch_rkv import scheme as S
from torch_rkv.cache import QuantizedKVCache
from torch_rkv.channels import KeyChannels, block_params, refine
from torch_rkv.eval.simulate import Simulation
from torch_rkv.paged import PagedQuantizedKVCache


def keys(seed: int, heads: int = 2, n: int = 48, d: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(heads, 1, d, generator=g) * 8 + 0.01  # channels of very different ranges
    return (torch.randn(1, heads, n, d, generator=g) * spread + torch.randn(heads, 1, d, generator=g) * 4)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bits=st.sampled_from([2, 3, 4]), extra=st.integers(1, 4),
       sinks=st.integers(0, 3))
def test_a_refined_value_is_within_its_sub_cell(seed, bits, extra, sinks):
    """With its block's unclipped range, a refined value is within scale / 2^(extra + 1) of the key (the
    code alone: scale / 2), and the bound is tight: some value comes close to it."""
    x = keys(seed)
    s = S.recommended(bits).replace(k_block_tokens=16)
    scale, zero = block_params(x, s, sinks)
    back = refine(x, scale, zero, bits, extra)
    err = (back - x).abs()[..., sinks:, :]
    bound = scale[..., sinks:, :] / (1 << (extra + 1))
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()
    assert (err > bound * 0.8).any()


def test_a_constant_channel_decodes_to_its_zero():
    x = torch.full((1, 1, 16, 4), 2.5)
    s = S.recommended(2).replace(k_block_tokens=16)
    scale, zero = block_params(x, s)
    assert (scale == 0).all()
    assert torch.equal(refine(x, scale, zero, 2, 2), zero)


def ranking(heads: int = 2, d: int = 16, layers: int = 1, seed: int = 0) -> KeyChannels:
    g = torch.Generator().manual_seed(seed)
    return KeyChannels([[torch.randperm(d, generator=g).tolist() for _ in range(heads)] for _ in range(layers)], "m")


def test_the_ranking_file_round_trips_and_names_what_is_wrong(tmp_path):
    r = ranking()
    path = tmp_path / "ranks.json"
    r.save(path)
    back = channels.load(str(path))
    assert back.ranks == r.ranks
    assert back.top(0, 3).tolist() == [h[:3] for h in r.ranks[0]]
    assert back.mask(0, 3, 16).sum(dim=1).tolist() == [3, 3]
    with pytest.raises(ValueError, match="layer 1 is out of range"):
        back.top(1, 3)
    with pytest.raises(ValueError, match="k_refine 17 is not within"):
        back.top(0, 17)
    with pytest.raises(ValueError, match="the keys have 32"):
        back.mask(0, 3, 32)
    with pytest.raises(ValueError, match="does not rank each of its 16 channels once"):
        KeyChannels([[[0] * 16]])
    with pytest.raises(ValueError, match="not a torch_rkv key-channel file"):
        KeyChannels.from_json('{"format": "torch_rkv.codebook/1", "ranks": []}')
    with pytest.raises(FileNotFoundError, match="does not exist"):
        channels.load(str(tmp_path / "missing.json"))


def test_the_scheme_counts_refinement_bits_checks_its_fields_and_serves_whole_bytes(tmp_path):
    path = tmp_path / "ranks.json"
    ranking(d=64).save(path)
    s = S.recommended(2).replace(k_refine=8, k_refine_bits=2, channels=str(path))
    plain = S.recommended(2)
    assert s.bits_parts(64)["codes"] == plain.bits_parts(64)["codes"] + 8 * 2 / 64 / 2
    assert "8 key channels 2 bits finer" in s.describe(64)
    with pytest.raises(ValueError, match="give both, or neither"):
        plain.replace(k_refine=8)
    with pytest.raises(ValueError, match="give both, or neither"):
        plain.replace(channels=str(path))
    with pytest.raises(ValueError, match="k_refine_bits must be 1 to 4"):
        s.replace(k_refine_bits=5)
    with pytest.raises(ValueError, match="k_refine must be >= 0"):
        plain.replace(k_refine=-1)
    for bad in (lambda: S.per_token(2).replace(k_refine=8, channels=str(path)), lambda: s.replace(outliers=0.005),
                lambda: S.kivi(2).replace(k_refine=8, channels=str(path))):  # (kivi: post-RoPE keys)
        with pytest.raises(ValueError, match="refines per-channel pre-RoPE key codes"):
            bad()
    with pytest.raises(NotImplementedError, match="at most 256 key channels a head"):
        s.replace(k_refine=260).check_served()
    with pytest.raises(ValueError, match="k_refine 65 exceeds head_dim 64"):
        s.replace(k_refine=65).check_head_dim(64)
    for odd in (s.replace(k_refine_bits=1), s.replace(k_refine=3)):  # 1 bit; 6 bits a row
        for make in (lambda: QuantizedKVCache(odd, 1, 1, 2, 64, 32), lambda: PagedQuantizedKVCache(odd, 1, 2, 64, 4, 1)):
            with pytest.raises(NotImplementedError, match="simulated only"):
                make()
    QuantizedKVCache(s, 1, 1, 2, 64, 32, rope=torch_rkv.rope_tables(64, 128))  # served


@pytest.mark.parametrize("count", [0, 3, 16])
def test_the_simulation_refines_the_ranked_channels_and_codes_the_rest(tmp_path, count):
    """Simulation.round_trip: the ranked channels within the refinement's bound, every other channel
    exactly the plain codes' round trip (clipped, as rkv-2 clips)."""
    path = tmp_path / "ranks.json"
    r = ranking()
    r.save(path)
    plain = S.recommended(2).replace(k_block_tokens=16)
    s = plain.replace(k_refine=count, channels=str(path)) if count else plain
    x = keys(7)
    tables = torch.ones(64, 8), torch.zeros(64, 8)  # (round_trip works in the storage space: no RoPE here)
    got = Simulation(s, *tables).round_trip(x, "k", s, layer=0)
    want = Simulation(plain, *tables).round_trip(x, "k", plain, layer=0)
    mask = r.mask(0, count, 16)[None, :, None, :].expand_as(x)
    assert torch.equal(got[~mask], want[~mask])
    scale, _ = block_params(x, plain)
    assert ((got - x).abs()[mask] <= (scale / 8)[mask] * (1 + 1e-5) + 1e-6).all()
    if count:
        assert ((got - x).abs()[mask].pow(2).sum() < (want - x).abs()[mask].pow(2).sum() / 4)
        with pytest.raises(ValueError, match="needs the layer"):
            Simulation(s, *tables).round_trip(x, "k", s)
    assert torch.equal(Simulation(s, *tables).round_trip(x, "v", s, layer=0),
                       Simulation(plain, *tables).round_trip(x, "v", plain, 0))


def test_calibration_ranks_a_channel_no_query_reads_last():
    """torch_rkv.eval.channels.calibrate on a tiny model: each head's channels ranked once; a rotated pair
    the queries never use (its query weights zeroed) moves no score, so it ranks last in every head."""
    from torch_rkv.eval import channels as calibration

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=160, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.q_proj.weight.view(6, 32, 192)
            w[:, 5] = 0  # rotate-half pairs channel 5 with 21
            w[:, 21] = 0
    ids = torch.randint(0, 160, (1, 320), generator=torch.Generator().manual_seed(3))
    ranks = calibration.calibrate(model, ids)
    assert len(ranks.ranks) == 2
    for layer in ranks.ranks:
        for order in layer:
            assert sorted(order) == list(range(32))
            assert set(order[-2:]) == {5, 21}


def refined_caches(tmp_path, device, n=200):
    """A rkv-2 scheme with 8 refined channels of 2 bits (blocks of 32) and the post-RoPE keys, values and
    rope tables of one sequence of n tokens."""
    path = tmp_path / "ranks.json"
    ranking(d=64, seed=3).save(path)
    s = S.recommended(2).replace(k_block_tokens=32, recent=16, k_refine=8, k_refine_bits=2, channels=str(path))
    g = torch.Generator().manual_seed(4)
    cos, sin = torch_rkv.rope_tables(64, n + 64, theta=1e4)
    k = torch_rkv.rope(keys(5, n=n, d=64), cos, sin, torch.arange(n))
    v = torch.randn(1, 2, n, 64, generator=g)
    return s, k, v, (cos, sin)


@pytest.mark.parametrize("device", device_params("cache_append"))
def test_the_cache_stores_what_the_simulation_computes(tmp_path, device):
    """QuantizedKVCache with refined key channels holds exactly the simulation's round trip (the decode
    protocol's condition), and its refined channels come back finer than a plain cache's."""
    s, k, v, rope = refined_caches(tmp_path, device)
    n = k.shape[2]
    cache = QuantizedKVCache(s, 1, 1, 2, 64, n, torch.float32, device=device, rope=rope)
    cache.append(0, k.to(device), v.to(device))
    kd, vd = (t.cpu() for t in cache.dequantized(0))
    q = ref.quantized_count(n, s.recent, s.block)
    sim = Simulation(s, *rope)
    want = sim.fake_quantize(k, "k", 0)
    assert (kd[:, :, s.sinks:q] - want[:, :, s.sinks:q]).abs().max() <= 1e-4
    plain = QuantizedKVCache(s.replace(k_refine=0, channels=None), 1, 1, 2, 64, n, torch.float32, rope=rope)
    plain.append(0, k, v)
    pk, _ = plain.dequantized(0)
    err = lambda a: (a - k)[:, :, s.sinks:q].pow(2).sum().item()  # noqa: E731
    assert err(kd) < err(pk)


@pytest.mark.parametrize("device", device_params("paged_decode_attention"))
def test_the_paged_cache_reads_refined_channels_and_a_fork_copies_them(tmp_path, device):
    """The paged cache attends as the contiguous one over the same tokens, and a fork (whose open page is
    copied with its refinement codes) as its parent."""
    s, k, v, rope = refined_caches(tmp_path, device, n=100)  # the open page 1 holds a written block, 64..95
    n = k.shape[2]
    flat = lambda t: t[0].transpose(0, 1).contiguous().to(device)  # noqa: E731  (1, H, n, D) -> (n, H, D)
    paged = PagedQuantizedKVCache(s, 1, 2, 64, 8, 2, page_size=64, dtype=torch.float32, rope=rope, device=device,
                                  max_pages_per_seq=2)
    seq = paged.add()
    batch = paged.schedule([seq], [n])
    paged.append(0, batch, flat(k), flat(v))
    paged.commit(batch)
    child = paged.fork(seq)
    contiguous = QuantizedKVCache(s, 1, 1, 2, 64, n + 8, torch.float32, device=device, rope=rope)
    contiguous.append(0, k.to(device), v.to(device))
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(9)).to(device)
    want = contiguous.attend(0, q).cpu()
    for s_id in (seq, child):
        got = paged.attend(0, paged.schedule([s_id], [0]), q).cpu()
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    parent_page, child_page = paged.k_refine[0][paged.pages_of(seq)[-1]], paged.k_refine[0][paged.pages_of(child)[-1]]
    assert parent_page[:, :32].any() and torch.equal(child_page, parent_page)


def test_the_vllm_plugin_and_plan_name_refined_channels_by_one_variable(monkeypatch, tmp_path, capsys):
    """TORCH_RKV_CHANNELS=<m>:<file> refines the plugin's scheme (or every layer of its allocation), a bad
    value or file fails before vLLM starts, naming it; `plan --vllm --schemes <preset>+<m> --channels FILE`
    counts the refinement's bytes and prints the command that serves it."""
    import json

    from torch_rkv.__main__ import main
    from torch_rkv.integrations import vllm

    path = tmp_path / "ranks.json"
    ranking(heads=3, d=64, layers=30).save(path)
    monkeypatch.setenv(vllm.ENV, "rkv-lean-2")
    monkeypatch.setenv(vllm.CHANNELS_ENV, f"8:{path}")
    s = vllm.configured_scheme()
    assert (s.name, s.k_refine, s.k_refine_bits, s.channels) == ("rkv-lean-2+8", 8, 2, str(path))
    for bad, error, match in (("8", ValueError, "TORCH_RKV_CHANNELS='8': write <channels per KV head>"),
                              (f"x:{path}", ValueError, "write <channels per KV head>"),
                              ("8:/no/such.json", FileNotFoundError, "/no/such.json does not exist")):
        monkeypatch.setenv(vllm.CHANNELS_ENV, bad)
        with pytest.raises(error, match=match):
            vllm.configured_scheme()
    monkeypatch.setenv(vllm.CHANNELS_ENV, f"8:{path}")
    monkeypatch.delenv(vllm.ENV)
    with pytest.raises(ValueError, match="TORCH_RKV_CHANNELS is set but neither TORCH_RKV_SCHEME"):
        vllm.configured_scheme()
    monkeypatch.delenv(vllm.CHANNELS_ENV)
    assert main(["plan", "--model", "smollm2-135m", "--vllm", "--budget-gb", "2", "--context", "4096", "--schemes",
                 "rkv-lean-2", "rkv-lean-2+8", "--channels", str(path), "--json"]) == 0
    *_, plain, refined_row = json.loads(capsys.readouterr().out)["rows"]
    assert refined_row["serve"]["env"] == {"TORCH_RKV_SCHEME": "rkv-lean-2", "TORCH_RKV_CHANNELS": f"8:{path}"}
    assert refined_row["bits_per_element"] == pytest.approx(plain["bits_per_element"] + 8 * 2 / 64 / 2)
    assert refined_row["page_bytes"] == plain["page_bytes"] + 3 * 128 * 2  # (a layer: 3 heads x 128 rows x 2 bytes)
    with pytest.raises(ValueError, match="--schemes rkv-lean-2\\+8: refined key channels need"):
        main(["plan", "--model", "smollm2-135m", "--vllm", "--schemes", "rkv-lean-2+8"])


@pytest.mark.parametrize("name, kind, bits", [("rkv-lean-alloc-3.6+8", "lean allocation", 3.6),
                                              ("rkv-lean-2+8", "preset", 0.0), ("rkv-alloc-2.5+12", "allocation", 2.5)])
def test_a_report_row_name_takes_a_refinement_suffix(name, kind, bits):
    """<row>+<m>: the row's schemes with m refined key channels a head; it prints back as written and is
    a per-layer row (each layer its own channels)."""
    from torch_rkv.eval.report import RowName

    row = RowName.parse(name)
    assert (row.kind, row.bits, row.refine, str(row), row.per_layer) == (kind, bits, int(name.split("+")[1]), name,
                                                                          True)
    assert RowName.parse(name.split("+")[0]).refine == 0


def test_the_plugins_variable_names_itself_on_a_scheme_that_cannot_refine(monkeypatch, tmp_path):
    from torch_rkv.integrations import vllm

    path = tmp_path / "ranks.json"
    ranking(heads=3, d=64, layers=30).save(path)
    monkeypatch.setenv(vllm.ENV, "kivi-2")
    monkeypatch.setenv(vllm.CHANNELS_ENV, f"8:{path}")
    with pytest.raises(ValueError, match="TORCH_RKV_CHANNELS='8:.*' on scheme kivi-2: Scheme: k_refine refines"):
        vllm.configured_scheme()
