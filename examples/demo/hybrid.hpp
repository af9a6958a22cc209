// kvcache_demo --hybrid: a hybrid model (attention every k-th layer, the reference
// recurrent layer of engine/recurrent_layer.hpp elsewhere, a SwiGLU MLP after every
// layer, deterministic random weights) over a kvcache::hybrid_memory, served through the
// slots and the global prompt cache with recurrent-state checkpoints (issue 28), and the
// TTFT scenarios run on it: exact repeat, growing prefix, multi-turn, and the same
// repeat without checkpoints (a full recompute, reported with its miss reason).
#pragma once

#include <Eigen/Core>

#include <algorithm>  // std::sort
#include <chrono>     // TTFT
#include <cmath>      // std::sqrt
#include <cstdint>    // fixed-width integers
#include <cstdio>     // progress lines
#include <optional>   // expected ratios
#include <span>       // token ranges
#include <string>     // labels
#include <vector>     // tokens, rows

#include <kvcache/kvcache.hpp>
#include <kvcache/prompt/slots.hpp>

#include "engine/compare.hpp"
#include "engine/kv_ops.hpp"
#include "engine/model.hpp"
#include "engine/recurrent_layer.hpp"
#include "engine/sampler.hpp"
#include "report.hpp"

namespace demo::hybrid {

using kvcache::pos_t;
using kvcache::seq_id_t;

/// The hybrid model: a Llama model's weights (embeddings, attention of the attention
/// layers, every layer's MLP, classifier) and one reference recurrent layer per recurrent
/// layer. Layer l is attention when l % attn_every == attn_every - 1.
struct hybrid_weights {
    llama_weights base;
    std::uint32_t attn_every = 4;
    std::vector<recurrent_layer_weights> rec;  ///< one per recurrent layer, in layer order

    [[nodiscard]] bool is_recurrent(std::size_t l) const noexcept { return l % attn_every != attn_every - 1; }
    [[nodiscard]] std::vector<bool> layer_map() const {
        std::vector<bool> m(base.layers.size());
        for (std::size_t l = 0; l < m.size(); ++l) m[l] = is_recurrent(l);
        return m;
    }
};

/// Deterministic random hybrid model (the recurrent layers' d_inner = dim / 2, d_state 8, d_conv 4).
inline hybrid_weights make_hybrid_model(const llama_config& cfg, std::uint32_t attn_every, std::uint64_t seed) {
    if (attn_every == 0 || attn_every > static_cast<std::uint32_t>(cfg.n_layers))
        throw model_error("make_hybrid_model: attn_every = " + std::to_string(attn_every) + ", must be in [1, n_layers]");
    hybrid_weights w;
    w.base = make_random_model(cfg, seed);
    w.attn_every = attn_every;
    for (int l = 0; l < cfg.n_layers; ++l)
        if (w.is_recurrent(static_cast<std::size_t>(l)))
            w.rec.push_back(recurrent_layer_weights::random(static_cast<std::uint32_t>(cfg.dim),
                                                            static_cast<std::uint32_t>(std::max(1, cfg.dim / 2)), 4, 8,
                                                            seed * 131 + static_cast<std::uint64_t>(l)));
    return w;
}

/// The memory of the hybrid model: f32 attention K/V (exact logits check) with the global
/// prompt cache over exact-prefix reuse, recurrent states in a recurrent_memory.
using hybrid_cache = kvcache::hybrid_memory<
    kvcache::kv_cache<kvcache::f32, kvcache::contiguous<>, kvcache::reuse::global<kvcache::reuse::lcp>>>;

/// Forward pass of the hybrid model over a hybrid_memory (one transaction per eval call).
class hybrid_engine {
public:
    using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using const_map = Eigen::Map<const matrix>;

    explicit hybrid_engine(const hybrid_weights& w) : w_(w) {}

    /// The memory this model needs: n_cells attention cells, n_seq_max sequences.
    [[nodiscard]] hybrid_cache make_cache(std::uint32_t n_cells, std::uint32_t n_seq_max) const {
        const llama_config& c = w_.base.config;
        kvcache::model_shape a;
        a.n_layer = static_cast<std::uint32_t>(c.n_layers) - static_cast<std::uint32_t>(w_.rec.size());
        a.n_head_kv = static_cast<std::uint32_t>(c.n_kv_heads);
        a.head_dim_k = static_cast<std::uint32_t>(c.head_dim());
        a.head_dim_v = a.head_dim_k;
        a.rope = c.rope;
        a.n_cells = n_cells;
        a.n_seq_max = n_seq_max;
        kvcache::recurrent_shape r;
        r.n_layer = static_cast<std::uint32_t>(w_.rec.size());
        r.n_seq_max = n_seq_max;
        r.d_conv = w_.rec.at(0).d_conv;
        r.d_inner = w_.rec.at(0).d_inner;
        r.ssm_size = w_.rec.at(0).ssm_size();
        return hybrid_cache(a, r, w_.layer_map());
    }

    /// Evaluates tokens at positions pos0, pos0 + 1, ... of sequence seq; logits of the last
    /// token. Throws model_error (bad token, no room); the memory is unchanged then.
    void eval(hybrid_cache& mem, std::span<const token_t> tokens, pos_t pos0, seq_id_t seq, std::vector<float>& logits) {
        const llama_config& cfg = w_.base.config;
        if (tokens.empty()) throw model_error("hybrid eval: no tokens");
        for (token_t t : tokens)
            if (t < 0 || t >= cfg.vocab_size) throw model_error("hybrid eval: token " + std::to_string(t) + " out of range");
        kvcache::transaction tx(mem);
        constexpr std::size_t ubatch = 512;
        for (std::size_t b0 = 0; b0 < tokens.size(); b0 += ubatch) {
            const std::size_t n = std::min(ubatch, tokens.size() - b0);
            ubatch_eval(mem, tokens.subspan(b0, n), pos0 + static_cast<pos_t>(b0), seq);
        }
        matrix last = x_.bottomRows(1);
        rms_norm(last, w_.base.rms_final, xn_);
        logits.resize(static_cast<std::size_t>(cfg.vocab_size));
        Eigen::Map<matrix> o(logits.data(), 1, cfg.vocab_size);
        o.noalias() = xn_ * const_map(w_.base.classifier(), cfg.vocab_size, cfg.dim).transpose();
        tx.commit();
    }

private:
    void rms_norm(const matrix& in, const std::vector<float>& weight, matrix& out) const {
        out.resize(in.rows(), in.cols());
        for (Eigen::Index r = 0; r < in.rows(); ++r) {
            const float ms = in.row(r).squaredNorm() / static_cast<float>(in.cols());
            const float inv = 1.0f / std::sqrt(ms + w_.base.config.norm_eps);
            for (Eigen::Index j = 0; j < in.cols(); ++j) out(r, j) = in(r, j) * inv * weight[static_cast<std::size_t>(j)];
        }
    }
    static void project(const matrix& in, const float* w, Eigen::Index n_out, matrix& out) {
        out.resize(in.rows(), n_out);
        out.noalias() = in * const_map(w, n_out, in.cols()).transpose();
    }

    void ubatch_eval(hybrid_cache& mem, std::span<const token_t> tokens, pos_t pos0, seq_id_t seq) {
        const llama_config& cfg = w_.base.config;
        const auto n = static_cast<Eigen::Index>(tokens.size());
        const Eigen::Index d = cfg.dim, kv = cfg.kv_dim();
        const auto hd = static_cast<std::uint32_t>(cfg.head_dim());
        pos_.resize(tokens.size());
        for (std::size_t i = 0; i < tokens.size(); ++i) pos_[i] = pos0 + static_cast<pos_t>(i);
        seqs_.assign(tokens.size(), seq);
        auto placed = mem.place(pos_, seqs_);
        if (!placed) throw model_error("hybrid eval: cannot place " + std::to_string(n) + " tokens: " + placed.message());
        x_.resize(n, d);
        for (Eigen::Index i = 0; i < n; ++i)
            x_.row(i) = const_map(w_.base.tok_embedding.data() + static_cast<std::size_t>(tokens[static_cast<std::size_t>(i)]) * d, 1, d);
        kv_ops::attention_params ap;
        ap.n_head = static_cast<std::uint32_t>(cfg.n_heads);
        std::size_t r = 0;  // recurrent layer index
        for (std::size_t l = 0; l < w_.base.layers.size(); ++l) {
            const layer_weights& lw = w_.base.layers[l];
            const auto layer = static_cast<std::uint32_t>(l);
            rms_norm(x_, lw.rms_att, xn_);
            if (w_.is_recurrent(l)) {  // the reference recurrent layer, token after token
                const recurrent_layer_weights& rw = w_.rec[r++];
                tmp_.resize(n, d);
                auto conv = mem.conv_state(layer, seq);
                auto ssm = mem.ssm_state(layer, seq);
                for (Eigen::Index i = 0; i < n; ++i) rec_.step(rw, xn_.row(i).data(), tmp_.row(i).data(), conv, ssm);
            } else {
                project(xn_, lw.wq.data(), d, q_);
                project(xn_, lw.wk.data(), kv, k_);
                project(xn_, lw.wv.data(), kv, v_);
                kv_ops::rope_rows(q_.data(), static_cast<std::size_t>(n), static_cast<std::uint32_t>(cfg.n_heads), hd,
                                  pos_.data(), mem.attention().shape().rope);
                kv_ops::rope_rows(k_.data(), static_cast<std::size_t>(n), static_cast<std::uint32_t>(cfg.n_kv_heads), hd,
                                  pos_.data(), mem.attention().shape().rope);
                mem.write_k(layer, placed.value(), k_.data());
                mem.write_v(layer, placed.value(), v_.data());
                att_.resize(n, d);
                kv_ops::attention(mem.attention(), mem.local_layer(layer), q_.data(), pos_.data(), seqs_.data(),
                                  static_cast<std::uint32_t>(n), ap, att_.data(), ws_);
                project(att_, lw.wo.data(), d, tmp_);
            }
            x_ += tmp_;
            rms_norm(x_, lw.rms_ffn, xn_);
            project(xn_, lw.w1.data(), cfg.hidden_dim, g_);
            project(xn_, lw.w3.data(), cfg.hidden_dim, u_);
            g_ = g_.array() / (1.0f + (-g_.array()).exp()) * u_.array();
            project(g_, lw.w2.data(), d, tmp_);
            x_ += tmp_;
        }
    }

    const hybrid_weights& w_;
    matrix x_, xn_, q_, k_, v_, att_, g_, u_, tmp_;
    std::vector<pos_t> pos_;
    std::vector<seq_id_t> seqs_;
    recurrent_layer rec_;
    kv_ops::attention_workspace ws_;
};

/// What serving one request did.
struct hybrid_response {
    double ttft_ms = 0;
    kvcache::request_metrics metrics;
    std::vector<float> logits;
    std::vector<token_t> generated;
    std::size_t checkpoint_bytes = 0;  ///< the slot's checkpoint bytes after the request
};

/// A minimal server over the hybrid memory: prepare, compute the rest in pieces that end
/// where prepared_request::checkpoints says (save_checkpoint there, unless checkpoints are
/// off), sample, generate, release.
class hybrid_server {
public:
    hybrid_server(hybrid_engine& e, hybrid_cache& mem, const kvcache::slot_options& so, bool checkpoints)
        : engine_(e), mem_(mem), slots_(mem, so), checkpoints_(checkpoints) {}

    [[nodiscard]] kvcache::slot_manager<hybrid_cache>& slots() noexcept { return slots_; }

    hybrid_response serve(const std::vector<token_t>& prompt, int n_generate, sampler& smp) {
        using clock = std::chrono::steady_clock;
        hybrid_response r;
        const auto t0 = clock::now();
        const kvcache::prompt_tokens request{std::span<const token_t>(prompt)};
        const kvcache::prepared_request p = slots_.prepare(request).value();
        r.metrics = p.metrics;
        try {
            std::size_t at = p.n_past;
            const std::span<const token_t> all(prompt);
            if (checkpoints_)
                for (std::uint32_t b : p.checkpoints) {
                    engine_.eval(mem_, all.subspan(at, b - at), static_cast<pos_t>(at), p.seq, r.logits);
                    at = b;
                    static_cast<void>(slots_.save_checkpoint(p.slot));  // a refused checkpoint only costs reuse later
                }
            engine_.eval(mem_, all.subspan(at), static_cast<pos_t>(at), p.seq, r.logits);
            slots_.commit_prompt(p.slot);
            token_t t = smp.sample(r.logits);
            r.ttft_ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
            r.generated.push_back(t);
            std::vector<float> logits;
            for (int i = 1; i < n_generate; ++i) {
                const std::vector<token_t> one{t};
                engine_.eval(mem_, one, static_cast<pos_t>(slots_.tokens(p.slot).size()), p.seq, logits);
                slots_.append(p.slot, t);
                t = smp.sample(logits);
                r.generated.push_back(t);
            }
        } catch (...) {
            slots_.release(p.slot);
            throw;
        }
        slots_.release(p.slot);
        r.checkpoint_bytes = slots_.checkpoint_bytes(p.slot);
        return r;
    }

private:
    hybrid_engine& engine_;
    hybrid_cache& mem_;
    kvcache::slot_manager<hybrid_cache> slots_;
    bool checkpoints_;
};

/// Max |logits difference| a cached request may show against its cold recomputation.
inline constexpr double hybrid_logits_tol = 1e-4;

/// The TTFT scenarios on the hybrid model. text(n) gives n fresh tokens (no BOS).
template <class Text>
class hybrid_runner {
public:
    hybrid_runner(const hybrid_weights& w, Text& text, std::size_t base_tokens, bool timing, bool strict_timing = false)
        : w_(w), engine_(w), verify_engine_(w), text_(text), n_(base_tokens), timing_(timing),
          strict_timing_(strict_timing) {}

    std::vector<report::row> run() {
        std::vector<token_t> base{1};  // BOS
        const auto body = text_.tokens(n_ - 1);
        base.insert(base.end(), body.begin(), body.end());
        exact_repeat(base, true);
        growing_prefix(base);
        multi_turn();
        exact_repeat(base, false);
        return rows_;
    }

private:
    std::uint32_t n_cells() const { return static_cast<std::uint32_t>(n_) * 2 + 256; }

    struct setup {
        hybrid_cache mem;
        hybrid_server srv;
        setup(hybrid_engine& e, std::uint32_t cells, bool checkpoints)
            : mem(e.make_cache(cells, 1)), srv(e, mem, opts(checkpoints), checkpoints) {}
        static kvcache::slot_options opts(bool checkpoints) {
            kvcache::slot_options so;
            so.n_slots = 1;
            so.checkpoint_every = checkpoints ? 256 : 0;
            so.checkpoint_tail = checkpoints ? 1 : 0;
            so.max_checkpoints = 4;
            return so;
        }
    };

    demo::logits_comparison cold(const std::vector<token_t>& prompt, const std::vector<float>& got) {
        hybrid_cache mem = verify_engine_.make_cache(n_cells(), 1);
        std::vector<float> want;
        verify_engine_.eval(mem, prompt, 0, 0, want);
        return demo::compare_logits(got.data(), want.data(), want.size());
    }

    hybrid_response serve(setup& s, const std::string& scenario, int round, const std::string& what,
                          const std::vector<token_t>& prompt, std::optional<double> expected, bool verify,
                          int n_generate = 1) {
        demo::sampler greedy(0.0f, 0);
        hybrid_response r = s.srv.serve(prompt, n_generate, greedy);
        report::row x;
        x.scenario = scenario;
        x.round = round;
        x.what = what;
        x.n_prompt = prompt.size();
        x.m = r.metrics;
        x.ttft_ms = r.ttft_ms;
        if (round == 1) cold_ms_ = r.ttft_ms;
        x.ratio = r.ttft_ms / cold_ms_;
        x.expected_max = expected;
        x.checkpoint_bytes = r.checkpoint_bytes;
        if (verify) {
            const demo::logits_comparison c = cold(prompt, r.logits);
            x.max_abs_diff = c.max_abs_diff;
            x.argmax_match = c.argmax_same;
            x.check_ok = c.ok(hybrid_logits_tol);
            char buf[64];
            std::snprintf(buf, sizeof buf, "%.1e %s", c.max_abs_diff, c.argmax_same ? "same" : "ARGMAX!");
            x.check = buf;
        }
        judge(x, timing_, strict_timing_);
        std::printf("  %-22s r%d %-30s %5zu tok  computed %5u  TTFT %8.1f ms  ratio %6.1f%%  ckpt %s, %zu KiB  miss %s  %s\n",
                    scenario.c_str(), round, what.c_str(), prompt.size(), x.m.computed, x.ttft_ms, 100.0 * x.ratio,
                    x.m.checkpoint_restored ? "restored" : "-", r.checkpoint_bytes / 1024,
                    kvcache::to_string(x.m.miss), x.pass && !x.off_target ? "" : result_label(x));
        std::fflush(stdout);
        rows_.push_back(x);
        return r;
    }

    void exact_repeat(const std::vector<token_t>& base, bool checkpoints) {
        const std::string name = checkpoints ? "exact repeat" : "no checkpoints";
        std::printf("scenario (hybrid): %s\n", name.c_str());
        setup s(engine_, n_cells(), checkpoints);
        serve(s, name, 1, "base (cold)", base, std::nullopt, false);
        if (checkpoints) {  // median of 5, as the attention model's scenario
            std::vector<report::row> reps;
            for (int i = 0; i < 5; ++i) {
                serve(s, name, 2, "same prompt again (median of 5)", base, 0.02, true);
                reps.push_back(rows_.back());
                rows_.pop_back();
            }
            std::sort(reps.begin(), reps.end(), [](const report::row& a, const report::row& b) { return a.ttft_ms < b.ttft_ms; });
            const auto bad = std::find_if(reps.begin(), reps.end(), [](const report::row& x) { return !x.check_ok; });
            rows_.push_back(bad != reps.end() ? *bad : reps[2]);
        } else {  // a full recompute, reported as a miss, never silently
            serve(s, name, 2, "same prompt again: full recompute", base, std::nullopt, true);
            report::row& x = rows_.back();
            const bool reported = x.m.computed == base.size() && x.m.miss == kvcache::miss_reason::no_checkpoint;
            x.check += reported ? "; miss no_checkpoint" : "; NOT REPORTED";
            x.check_ok = x.check_ok && reported;
            x.pass = x.pass && reported;
        }
    }

    void growing_prefix(const std::vector<token_t>& base) {
        std::printf("scenario (hybrid): growing prefix (+3 tokens per round)\n");
        setup s(engine_, n_cells(), true);
        std::vector<token_t> p = base;
        serve(s, "growing prefix", 1, "base (cold)", p, std::nullopt, false);
        for (int round = 2; round <= 4; ++round) {
            const auto ext = text_.tokens(3);
            p.insert(p.end(), ext.begin(), ext.end());
            serve(s, "growing prefix", round, "base + " + std::to_string(3 * (round - 1)) + " tokens", p, 0.10, true);
        }
    }

    void multi_turn() {
        std::printf("scenario (hybrid): multi-turn chat (full history every turn)\n");
        setup s(engine_, n_cells(), true);
        std::vector<token_t> history{1};
        const auto first = text_.tokens(n_ - 1);
        history.insert(history.end(), first.begin(), first.end());
        for (int turn = 1; turn <= 3; ++turn) {
            const hybrid_response r = serve(s, "multi-turn", turn, turn == 1 ? "system + user (cold)" : "history + reply + user",
                                            history, turn == 1 ? std::nullopt : std::optional<double>(0.10), turn > 1, 8);
            history.insert(history.end(), r.generated.begin(), r.generated.end());
            const auto user = text_.tokens(24);
            history.insert(history.end(), user.begin(), user.end());
        }
    }

    const hybrid_weights& w_;
    hybrid_engine engine_;
    hybrid_engine verify_engine_;
    Text& text_;
    std::size_t n_;
    bool timing_;
    bool strict_timing_;
    std::vector<report::row> rows_;
    double cold_ms_ = 1;
};

}  // namespace demo::hybrid
