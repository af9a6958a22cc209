// Writes the seed corpus: valid states of both fuzz shapes (whole cache and one
// sequence, with and without tokens/media, shared cells, pending shifts, duplicate
// positions from seq_div, a ring's pruning points), and of the state memories (recurrent
// "KVRS" and hybrid "KVHY" states: whole memory, one sequence, empty, with a prompt, and
// truncated copies), and of quantized caches (q8_0, q4_0 with transposed V).
// Usage: make_corpus <output dir> [<regressions dir>]. With a second directory it also
// writes the quantized-block inputs of regressions/ there: states whose blocks carry an
// inf or a NaN scale (they load: io/format.hpp, "Block elements"; the block reads back
// inf / NaN) and a state cut inside its last block (refused).
// The files in corpus/ and the quant_* files in regressions/ were made with it; run it
// again after a format change.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz_harness_rec.hpp"

namespace {

void write(const std::filesystem::path& dir, const std::string& name, const std::vector<std::byte>& b) {
    std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<const char*>(b.data()),
                                                      static_cast<std::streamsize>(b.size()));
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2 && argc != 3) {
        std::fprintf(stderr, "usage: make_corpus <output dir> [<regressions dir>]\n");
        return 2;
    }
    const std::filesystem::path dir = argv[1];
    std::filesystem::create_directories(dir);
    const std::vector<kvcache::token_t> tokens{3, 1, 4, -1, -1, 5, 9, 2};
    const std::vector<kvcache::media_chunk> media{{0x1234u, 3, 2}};

    kvcache::kv_cache<kvcache::f16> a(kvfuzz::shape_a());
    write(dir, "a_empty_whole", kvcache::io::save_state(a));
    kvfuzz::fill_baseline(a);
    write(dir, "a_whole", kvcache::io::save_state(a));
    write(dir, "a_whole_tokens", kvcache::io::save_state(a, tokens, media));
    write(dir, "a_seq0_tokens", kvcache::io::save_seq(a, 0, tokens, media));
    write(dir, "a_seq3", kvcache::io::save_seq(a, 3));
    a.seq_add(1, 1, -1, 5).value();
    a.seq_div(2, 0, -1, 2).value();
    write(dir, "a_whole_shifted", kvcache::io::save_state(a));
    write(dir, "a_seq2_shifted", kvcache::io::save_seq(a, 2));

    kvcache::kv_cache<kvcache::f32, kvcache::contiguous<kvcache::v_layout::transposed>> b(kvfuzz::shape_b());
    kvfuzz::fill_baseline(b);
    write(dir, "b_whole", kvcache::io::save_state(b));
    write(dir, "b_seq1_tokens", kvcache::io::save_seq(b, 1, tokens, media));
#ifdef KVFUZZ_HAS_PAGED_RING
    // States saved from paged and ring caches (their layout_id routes them to those targets).
    kvcache::kv_cache<kvcache::f16, kvcache::paged<32>> p(kvfuzz::shape_a_paged());
    kvfuzz::fill_baseline(p);
    write(dir, "paged_whole", kvcache::io::save_state(p));
    write(dir, "paged_seq0", kvcache::io::save_seq(p, 0, tokens, media));
    kvcache::kv_cache<kvcache::f16, kvcache::ring<8>> r(kvfuzz::shape_a());
    kvfuzz::fill_baseline(r);
    write(dir, "ring_whole", kvcache::io::save_state(r));
    write(dir, "ring_seq3", kvcache::io::save_seq(r, 3));
    // With pruning points (flags bit 0 and the table after the cells) and pending shifts.
    kvfuzz::prune_baseline(r);
    r.seq_add(1, 1, -1, 2).value();
    write(dir, "ring_pruned_whole", kvcache::io::save_state(r, tokens, media));
    write(dir, "ring_pruned_seq0", kvcache::io::save_seq(r, 0));
#endif

    // Recurrent and hybrid states (fuzz_harness_rec.hpp routes them by their magic).
    auto cut = [](std::vector<std::byte> b, std::size_t n) {
        b.resize(std::min(b.size(), n));
        return b;
    };
    kvcache::recurrent_memory rec(kvfuzz::rec_shape());
    write(dir, "rec_empty_whole", kvcache::io::save_state(rec));
    kvfuzz::rec_fill_baseline(rec);
    write(dir, "rec_whole", kvcache::io::save_state(rec));
    write(dir, "rec_whole_tokens", kvcache::io::save_state(rec, tokens));
    write(dir, "rec_seq2_tokens", kvcache::io::save_seq(rec, 2, tokens));
    write(dir, "rec_seq3_empty", kvcache::io::save_seq(rec, 3));
    write(dir, "rec_whole_truncated", cut(kvcache::io::save_state(rec), 200));
    write(dir, "rec_seq0_truncated", cut(kvcache::io::save_seq(rec, 0), 60));
    kvfuzz::rec_hybrid_t hyb(kvfuzz::shape_a(), kvfuzz::rec_shape(), kvfuzz::rec_hybrid_layers());
    kvfuzz::rec_fill_baseline(hyb);
    const auto hyb_whole = kvcache::io::save_state(hyb, tokens, media);
    write(dir, "hyb_whole_tokens", hyb_whole);
    write(dir, "hyb_seq0_tokens", kvcache::io::save_seq(hyb, 0, tokens, media));
    write(dir, "hyb_seq2", kvcache::io::save_seq(hyb, 2));
    write(dir, "hyb_whole_truncated", cut(hyb_whole, hyb_whole.size() / 2));
    hyb.seq_rm(-1, -1, -1).value();
    write(dir, "hyb_empty_whole", kvcache::io::save_state(hyb));

    // Quantized caches: valid seeds (whole, one sequence with tokens, pending shifts).
    kvcache::kv_cache<kvcache::q8_0> q8(kvfuzz::shape_q());
    kvfuzz::fill_baseline(q8);
    write(dir, "q8_whole", kvcache::io::save_state(q8));
    write(dir, "q8_seq0_tokens", kvcache::io::save_seq(q8, 0, tokens, media));
    kvcache::kv_cache<kvcache::q4_0, kvcache::contiguous<kvcache::v_layout::transposed>> q4(kvfuzz::shape_q());
    kvfuzz::fill_baseline(q4);
    q4.seq_add(2, 1, -1, 3).value();
    write(dir, "q4_whole_shifted", kvcache::io::save_state(q4));
    write(dir, "q4_seq3", kvcache::io::save_seq(q4, 3));
    if (argc == 3) {
        const std::filesystem::path reg = argv[2];
        std::filesystem::create_directories(reg);
        // One block's scale set to a binary16 bit pattern (layer 0, head 1, the first used cell).
        auto with_scale = [](auto& c, bool v_side, std::uint16_t bits) {
            auto v = c.storage().view(0);
            const std::uint32_t cell = *c.cells().used_cells().begin();
            auto& blk = v_side ? v.v[v.v_unit(1, cell, 0)] : v.k[v.k_unit(1, cell, 0)];
            const auto old = blk.d;
            blk.d = static_cast<kvcache::half>(bits);
            auto bytes = kvcache::io::save_state(c);
            blk.d = old;
            return bytes;
        };
        write(reg, "quant_q8_inf_scale_k", with_scale(q8, false, 0x7c00));   // +inf
        write(reg, "quant_q8_nan_scale_v", with_scale(q8, true, 0x7e00));    // quiet NaN
        write(reg, "quant_q4_nan_scale_k", with_scale(q4, false, 0xfe01));   // negative NaN, payload
        write(reg, "quant_q4_negative_scale_v", with_scale(q4, true, 0xbc00));  // -1: a valid block
        const auto whole = kvcache::io::save_state(q8);
        write(reg, "quant_q8_truncated_block", cut(whole, whole.size() - 8 - 20));  // inside the last V block
    }

    std::printf("make_corpus: wrote %s\n", dir.c_str());
    return 0;
}
