// The state-loader fuzz harness for the state memories (issue 28): recurrent states
// ("KVRS", io/recurrent.hpp) and hybrid states ("KVHY", io/hybrid.hpp), next to the K/V
// states of fuzz_harness.hpp. run_one_all routes an input by its magic: "KVRS" to a
// recurrent_memory, "KVHY" to a hybrid_memory<kv_cache<f16>>, anything else to
// kvfuzz::run_one (the K/V caches). Each input is loaded twice, as given and resealed
// (total_size and checksum rewritten to match; for a hybrid state the two inner parts
// too, when the part sizes add up), with load_seq into sequence 1 when its kind says one
// sequence, else with load_state. After every load:
//   - refused: every sequence's interval and state bytes (and for a hybrid memory the
//     attention part's saved bytes) must be exactly what they were before;
//   - accepted: both parts of a hybrid memory hold the same positions (per sequence the
//     same last position, the attention part no earlier first one); save -> load into a twin -> save must give the same bytes and the same
//     memory; and the memory must hold what the input means: a recurrent state saved
//     again with its prompt gives the input back byte for byte (one sequence: relabelled
//     with its saved sequence id), a hybrid memory equals a standalone attention cache
//     and recurrent memory that loaded the input's two parts separately.
// Any violation prints what happened and aborts (a libFuzzer crash).
#pragma once

#include <kvcache/io/hybrid.hpp>
#include <kvcache/io/recurrent.hpp>
#include <kvcache/memory/hybrid.hpp>
#include <kvcache/memory/recurrent.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "fuzz_harness.hpp"

namespace kvfuzz {

/// Inputs each target accepted so far (test_fuzz_replay checks that the seeds reach the
/// accepted path of both): [0] recurrent, [1] hybrid.
inline long rec_accepted[2] = {0, 0};

using rec_attention_t = kvcache::kv_cache<kvcache::f16>;
using rec_hybrid_t = kvcache::hybrid_memory<rec_attention_t>;

/// The recurrent shape of both targets: 2 layers, 4 sequences, 28 floats per sequence.
inline kvcache::recurrent_shape rec_shape() {
    kvcache::recurrent_shape s;
    s.n_layer = 2;
    s.n_seq_max = 4;
    s.d_conv = 3;
    s.d_inner = 4;
    s.ssm_size = 6;
    return s;
}
/// Model layers of the hybrid target: attention, recurrent, attention, recurrent (shape_a
/// has the two attention layers).
inline std::vector<bool> rec_hybrid_layers() { return {false, true, false, true}; }

/// Every sequence's interval and state bytes: equal exactly when two recurrent memories
/// of one shape hold the same states.
inline std::vector<std::byte> rec_picture(const kvcache::recurrent_memory& m) {
    std::vector<std::byte> out;
    auto put = [&](const void* p, std::size_t n) {
        const auto* b = static_cast<const std::byte*>(p);
        out.insert(out.end(), b, b + n);
    };
    for (kvcache::seq_id_t s = 0; s < static_cast<kvcache::seq_id_t>(m.n_seq_max()); ++s) {
        const kvcache::pos_t mn = m.seq_pos_min(s), mx = m.seq_pos_max(s);
        put(&mn, sizeof(mn));
        put(&mx, sizeof(mx));
        const auto st = m.seq_state(s);
        put(st.data(), st.size_bytes());
    }
    const bool tx = m.in_transaction();
    put(&tx, sizeof(tx));
    return out;
}
inline std::vector<std::byte> rec_picture(const rec_hybrid_t& h) {
    std::vector<std::byte> out = io::save_state(h.attention());
    const std::vector<std::byte> r = rec_picture(h.recurrent());
    out.insert(out.end(), r.begin(), r.end());
    return out;
}

/// Sequences 0..2 hold 3, 4, 5 tokens (states and, for a hybrid memory, K/V rows written
/// with fixed values); a hybrid memory's sequence 3 is a copy of sequence 0 (shared
/// attention cells), a recurrent memory's sequence 3 stays empty.
template <class M>
void rec_fill_baseline(M& m) {
    constexpr bool hybrid = !std::is_same_v<M, kvcache::recurrent_memory>;
    std::vector<float> k, v;
    if constexpr (hybrid) {
        k.resize(m.attention().shape().k_row_size());
        v.resize(m.attention().shape().v_row_size());
    }
    for (kvcache::seq_id_t s = 0; s < 3; ++s)
        for (kvcache::pos_t p = 0; p < 3 + s; ++p) {
            const kvcache::pos_t pos[1] = {p};
            const kvcache::seq_id_t seq[1] = {s};
            auto r = m.place(pos, seq);
            if (!r) die("recurrent", "baseline placement failed", r.message());
            auto step = [&](std::span<float> st, std::uint32_t l) {
                for (std::size_t i = 0; i < st.size(); ++i)
                    st[i] = st[i] * 0.5f + 0.125f * static_cast<float>((i + l + static_cast<std::size_t>(p)) % 13);
            };
            if constexpr (hybrid) {
                for (std::uint32_t l = 0; l < m.n_layer(); ++l) {
                    if (m.is_recurrent(l)) {
                        step(m.conv_state(l, s), l);
                        step(m.ssm_state(l, s), l);
                        continue;
                    }
                    for (std::size_t i = 0; i < k.size(); ++i) k[i] = 0.125f * static_cast<float>((i + l + p) % 17) - 1.0f;
                    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>((i * 3 + s) % 11) - 1.0f;
                    m.write_k(l, r.value(), k.data());
                    m.write_v(l, r.value(), v.data());
                }
            } else {
                for (std::uint32_t l = 0; l < m.n_layer(); ++l) {
                    step(m.conv_state(l, s), l);
                    step(m.ssm_state(l, s), l);
                }
            }
            static_cast<void>(m.commit());
        }
    if constexpr (hybrid)
        if (auto r = m.seq_cp(0, 3, -1, -1); !r) die("hybrid", "baseline seq_cp failed", r.message());
}

/// Rewrites total_size (offset 8) and the trailing checksum of a state to match its bytes.
inline void rec_reseal(std::span<std::byte> b) {
    if (b.size() < 16 + io::state_checksum_size) return;
    const std::uint64_t total = b.size();
    std::memcpy(b.data() + 8, &total, 8);
    const std::uint64_t h = io::checksum(std::span<const std::byte>(b.data(), b.size() - io::state_checksum_size));
    std::memcpy(b.data() + b.size() - io::state_checksum_size, &h, 8);
}

/// A recurrent state saved again from sequence 1, labelled as saved from sequence `seq`
/// (resealed): what a one-sequence input that loaded into sequence 1 must equal.
inline void rec_relabel(std::vector<std::byte>& b, kvcache::seq_id_t seq) {
    const std::int32_t s = seq;
    std::memcpy(b.data() + 40, &s, 4);
    if (io::detail::load_le<std::uint32_t>(b.data() + 44) == 1) {
        const auto n_tokens = io::detail::load_le<std::uint64_t>(b.data() + 48);
        std::memcpy(b.data() + io::recurrent_header_size + n_tokens * sizeof(kvcache::token_t), &s, 4);
    }
    rec_reseal(b);
}

/// The recurrent_memory under test.
struct rec_target {
    kvcache::recurrent_memory mem{rec_shape()}, twin{rec_shape()};
    std::vector<std::byte> baseline, picture;

    rec_target() {
        rec_fill_baseline(mem);
        baseline = io::save_state(mem);
        picture = rec_picture(mem);
    }

    void run(std::span<const std::byte> in, bool one_seq) {
        auto r = one_seq ? io::load_seq(mem, 1, in) : io::load_state(mem, in);
        if (!r) {
            if (rec_picture(mem) != picture) die("recurrent", "refused load changed the memory", r.message());
            return;
        }
        ++rec_accepted[0];
        const auto saved = io::save_state(mem);
        if (auto again = io::load_state(twin, saved); !again)
            die("recurrent", "a state saved after a load does not load", again.message());
        if (rec_picture(twin) != rec_picture(mem) || io::save_state(twin) != saved)
            die("recurrent", "save -> load -> save differs", "");
        std::vector<std::byte> re = one_seq ? io::save_seq(mem, 1, r.value().tokens) : io::save_state(mem, r.value().tokens);
        if (one_seq) rec_relabel(re, r.value().saved_seq);
        if (!std::equal(re.begin(), re.end(), in.begin(), in.end()))
            die("recurrent", "an accepted state saved again is not the input", "");
        if (auto back = io::load_state(mem, baseline); !back) die("recurrent", "baseline does not load", back.message());
        if (rec_picture(mem) != picture) die("recurrent", "baseline reloaded differs", "");
    }
};

/// The hybrid_memory under test, with a standalone attention cache and recurrent
/// memory at the same baseline (the input's parts loaded separately: its meaning).
struct rec_hybrid_target {
    std::unique_ptr<rec_hybrid_t> mem, twin;
    std::unique_ptr<rec_attention_t> ref_attn;
    std::unique_ptr<kvcache::recurrent_memory> ref_rec;
    std::vector<std::byte> baseline, picture, attn_baseline, rec_baseline;

    rec_hybrid_target()
        : mem(std::make_unique<rec_hybrid_t>(shape_a(), rec_shape(), rec_hybrid_layers())),
          twin(std::make_unique<rec_hybrid_t>(shape_a(), rec_shape(), rec_hybrid_layers())),
          ref_attn(std::make_unique<rec_attention_t>(shape_a())),
          ref_rec(std::make_unique<kvcache::recurrent_memory>(rec_shape())) {
        rec_fill_baseline(*mem);
        baseline = io::save_state(*mem);
        picture = rec_picture(*mem);
        attn_baseline = io::save_state(mem->attention());
        rec_baseline = io::save_state(mem->recurrent());
        reset_refs();
    }
    void reset_refs() {
        if (auto a = io::load_state(*ref_attn, attn_baseline); !a) die("hybrid", "attention baseline", a.message());
        if (auto b = io::load_state(*ref_rec, rec_baseline); !b) die("hybrid", "recurrent baseline", b.message());
    }

    void run(std::span<const std::byte> in, bool one_seq) {
        auto r = one_seq ? io::load_seq(*mem, 1, in) : io::load_state(*mem, in);
        if (!r) {
            if (rec_picture(*mem) != picture) die("hybrid", "refused load changed the memory", r.message());
            return;
        }
        ++rec_accepted[1];
        // Both parts hold the same positions: per sequence the same last position (and so
        // the same emptiness), the attention part no earlier first position.
        for (kvcache::seq_id_t s = 0; s < static_cast<kvcache::seq_id_t>(mem->n_seq_max()); ++s) {
            const auto& at = mem->attention();
            const auto& rc = mem->recurrent();
            if (at.seq_pos_max(s) != rc.seq_pos_max(s) || at.seq_pos_min(s) < rc.seq_pos_min(s))
                die("hybrid", "an accepted state's parts hold different positions",
                    "sequence " + std::to_string(s) + ": attention [" + std::to_string(at.seq_pos_min(s)) + ", " +
                        std::to_string(at.seq_pos_max(s)) + "], recurrent [" + std::to_string(rc.seq_pos_min(s)) +
                        ", " + std::to_string(rc.seq_pos_max(s)) + "]");
        }
        const auto& info = r.value();
        const auto saved = io::save_state(*mem, info.tokens, info.media);
        auto again = io::load_state(*twin, saved);
        if (!again) die("hybrid", "a state saved after a load does not load", again.message());
        if (rec_picture(*twin) != rec_picture(*mem) ||
            io::save_state(*twin, again.value().tokens, again.value().media) != saved)
            die("hybrid", "save -> load -> save differs", "");
        // The input's meaning: its two parts, loaded separately, give the same memories.
        const auto kind = one_seq ? kvcache::io::state_kind::one_sequence : kvcache::io::state_kind::whole_cache;
        auto parts = io::detail::parse_hybrid("fuzz", *mem, in, kind);
        if (!parts) die("hybrid", "an accepted state's envelope does not parse", parts.message());
        auto ra = one_seq ? io::load_seq(*ref_attn, 1, parts.value().attention)
                          : io::load_state(*ref_attn, parts.value().attention);
        auto rr = one_seq ? io::load_seq(*ref_rec, 1, parts.value().recurrent)
                          : io::load_state(*ref_rec, parts.value().recurrent);
        if (!ra || !rr) die("hybrid", "a part of an accepted state does not load alone", ra ? rr.message() : ra.message());
        if (io::save_state(*ref_attn) != io::save_state(mem->attention()))
            die("hybrid", "the attention part differs from the input's attention state", "");
        if (rec_picture(*ref_rec) != rec_picture(mem->recurrent()))
            die("hybrid", "the recurrent part differs from the input's recurrent state", "");
        if (auto back = io::load_state(*mem, baseline); !back) die("hybrid", "baseline does not load", back.message());
        if (rec_picture(*mem) != picture) die("hybrid", "baseline reloaded differs", "");
        reset_refs();
    }
};

/// Runs one input (as given and resealed) through the target its magic selects.
inline int run_one_all(const std::uint8_t* data, std::size_t size) {
    const auto* p = reinterpret_cast<const std::byte*>(data);
    const std::span<const std::byte> in(p, size);
    const std::uint32_t magic = size >= 4 ? io::detail::load_le<std::uint32_t>(p) : 0u;
    auto one_seq = [&] { return size >= 20 && io::detail::load_le<std::uint32_t>(p + 16) == 1; };
    if (magic == io::recurrent_magic) {
        static rec_target t;
        t.run(in, one_seq());
        std::vector<std::byte> fixed(p, p + size);
        rec_reseal(fixed);
        t.run(fixed, one_seq());
        return 0;
    }
    if (magic == io::hybrid_magic) {
        static rec_hybrid_target t;
        t.run(in, one_seq());
        std::vector<std::byte> fixed(p, p + size);
        if (size >= io::hybrid_header_size + io::state_checksum_size) {
            const auto a = io::detail::load_le<std::uint64_t>(p + 32), b = io::detail::load_le<std::uint64_t>(p + 40);
            const std::uint64_t inner = size - io::hybrid_header_size - io::state_checksum_size;
            if (a <= inner && b == inner - a) {  // the parts fill the envelope: reseal them too
                rec_reseal(std::span<std::byte>(fixed).subspan(io::hybrid_header_size, static_cast<std::size_t>(a)));
                rec_reseal(std::span<std::byte>(fixed).subspan(io::hybrid_header_size + static_cast<std::size_t>(a),
                                                                static_cast<std::size_t>(b)));
            }
        }
        rec_reseal(fixed);
        t.run(fixed, one_seq());
        return 0;
    }
    return run_one(data, size);
}

}  // namespace kvfuzz
