// kvcache_demo: the experiments. ttft_runner serves the TTFT scenarios through the slots
// and the global prompt cache (exact repeat, growing prefix, multi-turn chat, two slots,
// chunk reuse, cache_prompt = false) and checks each cached request against a cold run;
// run_context_shift and run_self_extend generate past the context with the library's
// kvcache::ops::context_shift and kvcache::ops::self_extend and check positions and K-shift.
// The step functions (context_shift_step, self_extend_step, check_chunk_moves) are what the
// runs call around the library, and what tests/demo/test_context.cpp tests.
#pragma once

#include <algorithm>         // std::sort, std::min, std::equal
#include <cctype>            // std::isprint
#include <cstddef>           // std::size_t, std::ptrdiff_t
#include <chrono>            // timings
#include <cmath>             // std::isfinite, std::abs
#include <cstdint>           // fixed-width integers
#include <cstdio>            // progress lines
#include <initializer_list>  // concat
#include <map>               // position multisets
#include <optional>          // expected ratios, planned positions
#include <span>              // token ranges
#include <stdexcept>         // std::logic_error
#include <string>            // labels
#include <type_traits>       // kshift_tol_for
#include <utility>           // std::pair
#include <vector>            // tokens, rows

#include <kvcache/kvcache.hpp>

#include "cli.hpp"
#include "engine/compare.hpp"
#include "engine/engine.hpp"
#include "engine/kshift_check.hpp"
#include "engine/sampler.hpp"
#include "engine/server.hpp"
#include "report.hpp"

namespace demo::scenarios {

using cli::options;
using report::check_result;
using report::row;
using clock_type = std::chrono::steady_clock;

/// The cache the server uses: f32 K/V (the logits check needs exact agreement), the
/// contiguous layout, and llama-server's reuse stack: a global prompt cache over LCP +
/// chunk shifting with n_cache_reuse = 32.
/// server_cache_of<E>: the same with K/V element E (--cache-type: f16, bf16, q8_0, q4_0).
template <class E = kvcache::f32>
using server_cache_of = kvcache::kv_cache<E, kvcache::contiguous<>,
                                          kvcache::reuse::global<kvcache::reuse::chunk_shift<32>>>;
using server_cache = server_cache_of<>;
/// The cache of the verification runs and of the context-shift / Self-Extend runs.
using plain_cache = kvcache::kv_cache<kvcache::f32>;

/// Tolerance of the K-shift checks (relative, against a float64 RoPE).
constexpr double kshift_tol = 1e-5;
/// The same for a cache of element E, whose K-shift rounds K to E again (|error| / (1 + |K|)
/// after one more rounding: f16 2^-11, bf16 2^-8; q8_0 max|x| / 254 and q4_0 max|x| / 16 of a
/// block of 32, measured on the demo's models with margin).
template <class E>
constexpr double kshift_tol_for = std::is_same_v<E, kvcache::f32>    ? kshift_tol
                                  : std::is_same_v<E, kvcache::f16>  ? 1e-3
                                  : std::is_same_v<E, kvcache::bf16> ? 8e-3
                                  : std::is_same_v<E, kvcache::q8_0> ? 0.05
                                                                     : 0.5;

// ------------------------------------------------------------------- steps and checks

/// What one context shift did and whether it checked out.
struct shift_step {
    kvcache::ops::context_shift_result plan;  ///< what kvcache::ops::context_shift removed and moved
    k_shift_report kshift;                    ///< K after the K-shift vs a float64 RoPE of K before
    bool kshift_ok = false;                   ///< error <= kshift_tol and every cell after n_keep moved
    bool contiguous = false;                  ///< the sequence holds positions [0, n_past_after) once each
};

/// F13, one step of endless generation: kvcache::ops::context_shift keeps n_keep positions of
/// sequence seq and discards half of the rest (its default), then the K-shift is applied
/// (kvcache::ops::apply_k_shift; the next eval would do it) and checked against a direct RoPE
/// of every cell's K before the shift. Throws what the library throws (kvcache::error; a
/// refused shift, an error result, is thrown by its value()).
template <class Cache>
shift_step context_shift_step(Cache& cache, seq_id_t seq, pos_t n_keep) {
    const std::vector<k_snapshot> before = snapshot_k(cache, seq, 0, cache.capacity());
    shift_step s;
    s.plan = kvcache::ops::context_shift(cache, seq, n_keep).value();
    kvcache::ops::apply_k_shift(cache);
    s.kshift = check_k_shift(cache, seq, before);
    const pos_t n_past = s.plan.n_past_after;
    s.kshift_ok = s.kshift.max_error <= kshift_tol &&
                  s.kshift.n_moved + static_cast<std::size_t>(s.plan.n_keep) == static_cast<std::size_t>(n_past);
    const auto& sp = cache.cells().seq_positions(seq);
    bool contiguous = sp.size() == static_cast<std::size_t>(n_past) &&
                      (n_past == 0 || (sp.begin()->first == 0 && sp.rbegin()->first == n_past - 1));
    for (const auto& [p, count] : sp) contiguous = contiguous && count == 1;
    s.contiguous = contiguous;
    return s;
}

/// F14, before each batch: kvcache::ops::self_extend groups sequence seq while n_past >=
/// st.ga_i + st.ga_w (it advances st.ga_i); if anything moved, the K-shift is applied and
/// checked against a direct RoPE at the new positions (seq_div included: llama.cpp records
/// the opposite sign there), the worst error and the moves added to `worst`. Returns the new n_past.
template <class Cache>
pos_t self_extend_step(Cache& cache, seq_id_t seq, kvcache::ops::self_extend_state& st, pos_t n_past,
                       k_shift_report& worst) {
    const std::vector<k_snapshot> before = snapshot_k(cache, seq, 0, cache.capacity());
    const pos_t after = kvcache::ops::self_extend(cache, seq, st, n_past).value();
    if (after != n_past) {
        kvcache::ops::apply_k_shift(cache);
        const k_shift_report r = check_k_shift(cache, seq, before);
        worst.max_error = nan_max(worst.max_error, r.max_error);
        worst.n_cells += r.n_cells;
        worst.n_moved += r.n_moved;
    }
    return after;
}

/// The closed form of Self-Extend's positions (the reference the runs check against): after
/// grouping up to st.ga_i, the token appended at uncompressed position p sits at
///   p / ga_n                  if p < ga_n * ga_i
///   p - (ga_n - 1) * ga_i     otherwise,
/// and n_past = tokens so far - (ga_n - 1) * ga_i.
[[nodiscard]] inline pos_t self_extend_closed_form(const kvcache::ops::self_extend_state& st, pos_t p) noexcept {
    return p < st.ga_n * st.ga_i ? p / st.ga_n : p - (st.ga_n - 1) * st.ga_i;
}

/// Where reuse plan p puts the cached position `pos`: kept in place below n_lcp, moved by the
/// chunk that holds it, or nothing (dropped) otherwise.
[[nodiscard]] inline std::optional<pos_t> planned_pos(const kvcache::reuse::plan& p, pos_t pos) noexcept {
    if (pos >= 0 && static_cast<std::uint32_t>(pos) < p.n_lcp) return pos;
    for (const kvcache::reuse::chunk_move& m : p.moves)
        if (pos >= m.src && pos - m.src < static_cast<pos_t>(m.n)) return m.dst + (pos - m.src);
    return std::nullopt;
}

/// Result of check_chunk_moves.
struct chunk_report {
    k_shift_report kshift;     ///< over the snapshotted cells the plan keeps or moves
    std::size_t n_kept = 0;    ///< snapshotted cells the plan keeps or moves
    std::size_t n_moved = 0;   ///< of those, cells the plan moves to another position
    bool positions_ok = false; ///< every kept/moved cell is where the plan says
    bool tokens_ok = false;    ///< every move carries cached tokens equal to the request's at dst
    double tol = kshift_tol;   ///< K-shift tolerance (kshift_tol_for<E> of the cache's element)
    /// What the library guarantees, and that something moved.
    [[nodiscard]] bool ok() const noexcept {
        return positions_ok && tokens_ok && n_moved > 0 && kshift.n_cells == n_kept && kshift.n_moved == n_moved &&
               kshift.max_error <= tol;
    }
};

/// After a request reused chunks (F20): checks what the library guarantees for the cells
/// snapshotted before it (snapshot_k of sequence seq): each one the plan keeps or moves holds
/// seq at the position the plan gives (planned_pos) and its K equals a direct RoPE of its old K
/// at the new position (after the K-shift); each move's cached tokens equal the request's
/// tokens at its destination. Cells the plan drops are not checked (the request's computed
/// tokens may reuse them). A fixed offset is not assumed: the prefix may also match the start
/// of the moved block (a tokenizer that encodes the block's first token like the old turn's).
template <class Cache>
chunk_report check_chunk_moves(const Cache& cache, seq_id_t seq, const std::vector<k_snapshot>& before,
                               const kvcache::reuse::plan& plan, std::span<const token_t> cached,
                               std::span<const token_t> request) {
    chunk_report r;
    std::vector<k_snapshot> kept;
    r.positions_ok = true;
    for (const k_snapshot& s : before) {
        const std::optional<pos_t> to = planned_pos(plan, s.pos);
        if (!to) continue;
        ++r.n_kept;
        if (*to != s.pos) ++r.n_moved;
        const auto& cells = cache.cells();
        r.positions_ok = r.positions_ok && !cells.is_free(s.cell) && cells.seqs(s.cell).test(seq) &&
                         cells.pos(s.cell) == *to;
        kept.push_back(s);
    }
    r.kshift = check_k_shift(cache, seq, kept);
    r.tokens_ok = true;
    for (const kvcache::reuse::chunk_move& m : plan.moves) {
        const auto src = static_cast<std::size_t>(m.src), dst = static_cast<std::size_t>(m.dst);
        r.tokens_ok = r.tokens_ok && src + m.n <= cached.size() && dst + m.n <= request.size() &&
                      std::equal(cached.begin() + static_cast<std::ptrdiff_t>(src),
                                 cached.begin() + static_cast<std::ptrdiff_t>(src + m.n),
                                 request.begin() + static_cast<std::ptrdiff_t>(dst));
    }
    return r;
}

// ---------------------------------------------------------------------------- helpers

/// The most positions a TTFT scenario holds beyond the base prompt: the multi-turn chat's
/// fourth turn (3 x (8 generated + 24 user) tokens more, then 7 more generated tokens evaluated).
inline constexpr int ttft_extra_positions = 103;
/// The base prompt when --base-tokens is not given: 1,000 tokens, fewer for a model whose
/// trained context is shorter (stories260K, 512: 409 tokens).
inline constexpr int default_base_tokens = 1000;

/// Fits the runs to the model's trained context (cfg.seq_len): an unset --base-tokens becomes
/// min(1000, seq_len - ttft_extra_positions); an explicit one that would take a TTFT scenario past
/// seq_len, or a --ctx larger than seq_len, is refused with cli::cli_error naming the argument,
/// its value and the limit. Self-Extend checks its own positions (run_self_extend).
inline void fit_to_model(options& o, const demo::llama_config& cfg) {
    using std::to_string;
    const int max_base = cfg.seq_len - ttft_extra_positions;
    if (o.ttft || o.tiers) {
        if (max_base < 64)
            throw cli::cli_error("the model's trained context is " + to_string(cfg.seq_len) +
                                 " positions: the TTFT scenarios need at least " + to_string(64 + ttft_extra_positions) +
                                 " (run --context-shift or --self-extend only)");
        if (o.base_tokens == 0) {
            o.base_tokens = std::min(default_base_tokens, max_base);
        } else if (o.base_tokens > max_base) {
            throw cli::cli_error("--base-tokens = " + to_string(o.base_tokens) + ": the TTFT scenarios hold up to " +
                                 to_string(ttft_extra_positions) + " positions more, the model's trained context is " +
                                 to_string(cfg.seq_len) + ": must be at most " + to_string(max_base));
        }
    }
    if (o.base_tokens == 0) o.base_tokens = std::min(default_base_tokens, std::max(64, max_base));
    if (o.context_shift && o.ctx > cfg.seq_len)
        throw cli::cli_error("--ctx = " + to_string(o.ctx) + ": larger than the model's trained context " +
                             to_string(cfg.seq_len));
}

/// The demo's default model: a Llama of a realistic small shape with deterministic random weights.
inline demo::llama_config default_config() {
    demo::llama_config c;
    c.dim = 512;
    c.hidden_dim = 1536;
    c.n_layers = 8;
    c.n_heads = 8;
    c.n_kv_heads = 2;
    c.vocab_size = 259;  // three specials + 256 bytes (the byte tokenizer)
    c.seq_len = 4096;
    c.shared_classifier = false;
    return c;
}

/// Deterministic English-looking text (words drawn with the seed), as tokens.
class text_source {
public:
    text_source(const demo::tokenizer& tok, std::uint64_t seed) : tok_(tok), rng_(seed) {}
    /// Exactly n tokens of fresh text (no BOS).
    std::vector<token_t> tokens(std::size_t n) {
        std::vector<token_t> t;
        while (t.size() < n) {
            const auto more = tok_.encode(words(24), false);
            t.insert(t.end(), more.begin(), more.end());
        }
        t.resize(n);
        return t;
    }

private:
    /// n words of text.
    std::string words(int n) {
        static const char* const vocabulary[] = {
            "the", "cache", "keeps", "every", "token", "of", "a", "prompt", "so", "that", "next", "request",
            "only", "computes", "what", "is", "new", "model", "attention", "reads", "keys", "and", "values",
            "from", "cells", "slot", "server", "user", "asks", "about", "history", "answer", "long", "short",
            "document", "chapter", "story", "little", "robot", "garden", "river", "morning", "quiet", "bright"};
        std::string s;
        for (int i = 0; i < n; ++i) {
            s += vocabulary[rng_.next() % (sizeof(vocabulary) / sizeof(vocabulary[0]))];
            s += rng_.next() % 9 == 0 ? ". " : " ";
        }
        return s;
    }

    const demo::tokenizer& tok_;
    demo::splitmix64 rng_;
};

/// The token lists one after the other.
inline std::vector<token_t> concat(std::initializer_list<const std::vector<token_t>*> parts) {
    std::vector<token_t> out;
    for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
    return out;
}

/// Milliseconds since t0.
inline double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// ------------------------------------------------------------------------------- TTFT

/// Computes a prompt from scratch in its own cache (K/V element E, the served cache's: a
/// hit must equal a cold run of the same cache type) and compares the logits.
template <class E = kvcache::f32>
class basic_verifier {
public:
    basic_verifier(const demo::llama_weights& w, std::uint32_t n_cells)
        : engine_(w), cache_(engine_.cache_shape(n_cells, 1)) {}

    /// Cold logits of `prompt` against `got` (vocab floats): max |diff| and argmax agreement;
    /// a NaN or infinity on either side is a mismatch (demo::compare_logits).
    demo::logits_comparison compare(const std::vector<token_t>& prompt, const std::vector<float>& got) {
        cache_.clear();
        std::vector<float> want;
        engine_.eval(cache_, prompt, 0, 0, want);
        if (got.size() != want.size())
            throw demo::model_error("verifier: " + std::to_string(got.size()) + " logits, the model has " +
                                    std::to_string(want.size()));
        return demo::compare_logits(got.data(), want.data(), want.size());
    }

private:
    demo::llama_engine<kvcache::kv_cache<E>> engine_;
    kvcache::kv_cache<E> cache_;
};
using verifier = basic_verifier<>;

/// Max |logits difference| a cached request may show against its cold recomputation.
inline constexpr double logits_tol = 1e-4;

/// The logits column of a row: "2.0e-06 same", "3.1e-01 ARGMAX!", or "NaN/inf logits".
[[nodiscard]] inline std::string logits_label(const demo::logits_comparison& c) {
    if (!c.finite) return "NaN/inf logits";
    char buf[48];
    std::snprintf(buf, sizeof buf, "%.1e %s", c.max_abs_diff, c.argmax_same ? "same" : "ARGMAX!");
    return buf;
}

/// The TTFT scenarios, each on a fresh server_cache_of<E> through the slots and the global
/// prompt cache; every request is a row (timing against the scenario's cold round, logits
/// against a cold recomputation with the same element where reuse must be exact).
template <class E = kvcache::f32>
class basic_ttft_runner {
    using server_cache = server_cache_of<E>;

public:
    basic_ttft_runner(const demo::llama_weights& w, const demo::tokenizer& tok, const options& o)
        : opt_(o), engine_(w), verify_(w, n_cells()), text_(tok, o.seed + 1) {}

    std::vector<row> run() {
        const auto n = static_cast<std::size_t>(opt_.base_tokens);
        std::vector<token_t> base{demo::tokenizer::bos};
        const auto body = text_.tokens(n - 1);
        base.insert(base.end(), body.begin(), body.end());

        exact_repeat(base);
        growing_prefix(base);
        multi_turn(n);
        two_slots(n);
        chunk_reuse(n);
        control(base);
        return rows_;
    }

private:
    std::uint32_t n_cells() const { return static_cast<std::uint32_t>(opt_.base_tokens) * 4 + 512; }

    /// A fresh cache + server per scenario, so scenarios never help each other.
    struct setup {
        server_cache cache;
        demo::server<server_cache> srv;
        setup(demo::llama_engine<server_cache>& e, std::uint32_t cells, std::uint32_t n_slots)
            : cache(e.cache_shape(cells, n_slots)), srv(e, cache, slot_opts(n_slots)) {}
        static kvcache::slot_options slot_opts(std::uint32_t n_slots) {
            kvcache::slot_options so;
            so.n_slots = n_slots;
            return so;
        }
    };

    /// Serves one request, verifies the logits (verify: exact agreement required), records the row.
    demo::response serve(setup& s, const std::string& scenario, int round, const std::string& what,
                         const std::vector<token_t>& prompt, std::optional<double> expected, bool verify,
                         int n_generate = 1, bool cache_prompt = true,
                         std::optional<double> expected_min = std::nullopt) {
        // fit_to_model sized the base prompt: no request may reach past the trained context.
        const std::size_t last_pos = prompt.size() + static_cast<std::size_t>(n_generate - 1);
        if (last_pos > static_cast<std::size_t>(engine_.config().seq_len))
            throw std::logic_error("ttft_runner: " + scenario + " round " + std::to_string(round) + " holds " +
                                   std::to_string(last_pos) + " positions, the model's trained context is " +
                                   std::to_string(engine_.config().seq_len) + " (ttft_extra_positions too small)");
        demo::sampler greedy(0.0f, 0);
        kvcache::request_options ro;
        ro.cache_prompt = cache_prompt;
        demo::response r = s.srv.serve(prompt, ro, n_generate, greedy);
        row x;
        x.scenario = scenario;
        x.cache_type = std::string(E::name);
        x.round = round;
        x.what = what;
        x.n_prompt = prompt.size();
        x.m = r.metrics;
        x.ttft_ms = r.ttft_ms;
        if (round == 1) cold_ms_ = r.ttft_ms;
        x.ratio = r.ttft_ms / cold_ms_;
        x.expected_max = expected;
        if (verify) {
            const demo::logits_comparison c = verify_.compare(prompt, r.logits);
            x.max_abs_diff = c.max_abs_diff;
            x.argmax_match = c.argmax_same;
            x.check_ok = c.ok(logits_tol);
            x.check = logits_label(c);
            if (!x.check_ok)
                std::fprintf(stderr, "LOGITS CHECK FAILED: %s round %d: max |diff| = %.3e (tol %.0e), argmax %s%s\n",
                             scenario.c_str(), round, c.max_abs_diff, logits_tol, c.argmax_same ? "same" : "differs",
                             c.finite ? "" : ", NON-FINITE logits");
        }
        x.expected_min = expected_min;
        judge(x, opt_.timing, opt_.strict_timing);
        std::printf("  %-15s r%d %-36s %5zu tok  computed %5u  TTFT %8.1f ms (prepare %6.1f)  ratio %6.1f%%  %s\n",
                    scenario.c_str(), round, what.c_str(), prompt.size(), x.m.computed, x.ttft_ms, r.prepare_ms,
                    100.0 * x.ratio, x.pass && !x.off_target ? "" : result_label(x));
        std::fflush(stdout);
        rows_.push_back(x);
        return r;
    }

    void exact_repeat(const std::vector<token_t>& base) {
        std::printf("scenario: exact repeat\n");
        setup s(engine_, n_cells(), 1);
        serve(s, "exact repeat", 1, "base (cold)", base, std::nullopt, false);
        // A repeat computes one token (~6 ms here), so one timer tick of machine noise moves
        // its ratio visibly: send the same prompt 5 times (each a new request, each logits-
        // checked) and keep the median row; a failed logits check is kept instead.
        constexpr int n_repeats = 5;
        const std::size_t first = rows_.size();
        for (int i = 0; i < n_repeats; ++i)
            serve(s, "exact repeat", 2, "same prompt again (median of 5)", base, 0.02, true);
        std::vector<row> reps(rows_.begin() + static_cast<std::ptrdiff_t>(first), rows_.end());
        rows_.resize(first);
        char first_ratio[64];  // the first repeat pays one-time warm-up; show it next to the median
        std::snprintf(first_ratio, sizeof first_ratio, "same prompt again (median of 5; first %.1f%%)",
                      100.0 * reps.front().ratio);
        for (auto& x : reps) x.what = first_ratio;
        std::sort(reps.begin(), reps.end(), [](const row& a, const row& b) { return a.ttft_ms < b.ttft_ms; });
        const auto bad = std::find_if(reps.begin(), reps.end(), [](const row& x) { return !x.check_ok; });
        rows_.push_back(bad != reps.end() ? *bad : reps[n_repeats / 2]);
    }

    void growing_prefix(const std::vector<token_t>& base) {
        std::printf("scenario: growing prefix (+3 tokens per round)\n");
        setup s(engine_, n_cells(), 1);
        std::vector<token_t> p = base;
        serve(s, "growing prefix", 1, "base (cold)", p, std::nullopt, false);
        for (int round = 2; round <= 4; ++round) {
            const auto ext = text_.tokens(3);
            p.insert(p.end(), ext.begin(), ext.end());
            serve(s, "growing prefix", round, "base + " + std::to_string(3 * (round - 1)) + " tokens", p, 0.10, true);
        }
    }

    void multi_turn(std::size_t n) {
        std::printf("scenario: multi-turn chat (full history every turn)\n");
        setup s(engine_, n_cells(), 1);
        std::vector<token_t> history{demo::tokenizer::bos};
        const auto first = text_.tokens(n - 1);
        history.insert(history.end(), first.begin(), first.end());
        for (int turn = 1; turn <= 4; ++turn) {
            const demo::response r = serve(s, "multi-turn", turn, turn == 1 ? "system + user (cold)" : "history + reply + user",
                                           history, turn == 1 ? std::nullopt : std::optional<double>(0.10), turn > 1, 8);
            history.insert(history.end(), r.generated.begin(), r.generated.end());  // the assistant's reply
            const auto user = text_.tokens(24);
            history.insert(history.end(), user.begin(), user.end());
        }
    }

    void two_slots(std::size_t n) {
        std::printf("scenario: two slots + global prompt cache (A, B, C, then A again)\n");
        setup s(engine_, n_cells(), 2);
        auto conversation = [&] {
            std::vector<token_t> c{demo::tokenizer::bos};
            const auto t = text_.tokens(n - 1);
            c.insert(c.end(), t.begin(), t.end());
            return c;
        };
        std::vector<token_t> a = conversation(), b = conversation(), c = conversation();
        const demo::response ra = serve(s, "global cache", 1, "A (cold, slot 0)", a, std::nullopt, false, 8);
        cold_a_ = cold_ms_;
        serve(s, "global cache", 2, "B (cold, slot 1)", b, std::nullopt, false, 8);
        serve(s, "global cache", 3, "C (cold, LRU slot 0)", c, std::nullopt, false, 8);
        // Rounds 2 and 3 are cold runs of their own; keep ratios relative to A's cold run.
        for (std::size_t i = rows_.size() - 2; i < rows_.size(); ++i) {
            rows_[i].ratio = rows_[i].ttft_ms / cold_a_;
            rows_[i].expected_max.reset();
        }
        cold_ms_ = cold_a_;
        std::vector<token_t> a2 = a;
        a2.insert(a2.end(), ra.generated.begin(), ra.generated.end());
        const auto more = text_.tokens(16);
        a2.insert(a2.end(), more.begin(), more.end());
        const demo::response r = serve(s, "global cache", 4, "A + reply + user at slot of B", a2, 0.15, true, 1);
        row& last = rows_.back();
        if (r.slot != 1 || r.metrics.from_global == 0) {
            std::fprintf(stderr, "GLOBAL CACHE CHECK FAILED: served by slot %d, %u tokens from the global cache\n",
                         r.slot, r.metrics.from_global);
            last.pass = false;
        }
    }

    void chunk_reuse(std::size_t n) {
        std::printf("scenario: chunk reuse (a %zu-token block moved after a changed prefix)\n", n * 6 / 10);
        setup s(engine_, n_cells(), 1);
        std::vector<token_t> sys{demo::tokenizer::bos};
        const auto t = text_.tokens(n / 10 - 1);
        sys.insert(sys.end(), t.begin(), t.end());
        const auto old_turn = text_.tokens(n - n / 10 - n * 6 / 10);
        const auto doc = text_.tokens(n * 6 / 10);
        const auto question = text_.tokens(10);
        const std::vector<token_t> first = concat({&sys, &old_turn, &doc});
        serve(s, "chunk reuse", 1, "system + old turn + document (cold)", first, std::nullopt, false);

        // Snapshot the document's cells: after the move, each cell the plan moves must sit where
        // the plan says and its K must equal a direct RoPE at its new position. Not a fixed
        // offset: with a real tokenizer the document's first token may also match the old turn's,
        // and the library then rightly keeps one more prefix token and moves one token less.
        const pos_t src = static_cast<pos_t>(sys.size() + old_turn.size());
        const std::vector<demo::k_snapshot> before = demo::snapshot_k(s.cache, 0, src, 64);

        const std::vector<token_t> second = concat({&sys, &doc, &question});
        const demo::response r = serve(s, "chunk reuse", 2, "system + document + question", second, 0.15, false);
        row& x = rows_.back();
        chunk_report cr = check_chunk_moves(s.cache, 0, before, r.plan, first, second);
        cr.tol = kshift_tol_for<E>;
        const bool moved = cr.ok() && r.plan.n_shifted() == r.metrics.from_shift;
        const double worst = cr.kshift.max_error;
        // The moved block's K/V were computed after the old turn, so (as in llama-server's
        // --cache-reuse) the logits approximate a cold run; report the difference.
        const demo::logits_comparison c = verify_.compare(second, r.logits);
        char buf[96];
        std::snprintf(buf, sizeof buf, "kshift %.0e; approx %.1e%s", worst, c.max_abs_diff,
                      !c.finite ? " (NaN/inf logits)" : c.argmax_same ? "" : " (argmax differs)");
        x.check = buf;
        x.max_abs_diff = c.max_abs_diff;
        x.argmax_match = c.argmax_same;
        // An approximation may differ, but never be NaN.
        x.check_ok = moved && r.metrics.from_shift >= 32 && c.finite;
        if (!x.check_ok)
            std::fprintf(stderr,
                         "CHUNK REUSE CHECK FAILED: %zu of %zu snapshotted cells moved (%zu checked, positions %s, "
                         "tokens %s), K-shift error %.3e, %u tokens shifted (plan: %u)%s\n",
                         cr.n_moved, before.size(), cr.n_kept, cr.positions_ok ? "ok" : "WRONG",
                         cr.tokens_ok ? "ok" : "WRONG", worst, r.metrics.from_shift, r.plan.n_shifted(),
                         c.finite ? "" : ", NON-FINITE logits");
        x.pass = x.pass && x.check_ok;
    }

    void control(const std::vector<token_t>& base) {
        std::printf("scenario: cache_prompt = false (control: everything recomputed)\n");
        setup s(engine_, n_cells(), 1);
        std::vector<token_t> p = base;
        serve(s, "cache_prompt=0", 1, "base (cold)", p, std::nullopt, false, 1, false);
        for (int round = 2; round <= 3; ++round) {
            const auto ext = text_.tokens(3);
            p.insert(p.end(), ext.begin(), ext.end());
            serve(s, "cache_prompt=0", round, "base + " + std::to_string(3 * (round - 1)) + " tokens", p, std::nullopt,
                  false, 1, false, 0.5);
            row& x = rows_.back();
            x.check = x.m.computed == p.size() ? "all recomputed" : "REUSED?";
            x.check_ok = x.m.computed == p.size();
            x.pass = x.pass && x.check_ok;
        }
    }

    const options& opt_;
    demo::llama_engine<server_cache> engine_;
    basic_verifier<E> verify_;
    text_source text_;
    std::vector<row> rows_;
    double cold_ms_ = 1;
    double cold_a_ = 1;
};
using ttft_runner = basic_ttft_runner<>;
// ---------------------------------------------------------------------- context shift

/// F13: generates past the context size; every time it is full, keeps n_keep tokens,
/// discards half of the rest and shifts the remainder left. Returns whether every check held.
inline check_result run_context_shift(const demo::llama_weights& w, const demo::tokenizer& tok, const options& o) {
    std::printf("\n== context shift (F13): n_ctx %d, n_keep %d, %d tokens to generate, temperature %.2f, seed %llu\n",
                o.ctx, o.n_keep, o.n_gen, static_cast<double>(o.temperature),
                static_cast<unsigned long long>(o.seed + 2));
    demo::llama_engine<plain_cache> eng(w);
    plain_cache cache(eng.cache_shape(static_cast<std::uint32_t>(o.ctx), 1));
    const std::size_t bytes = cache.total_bytes();
    text_source text(tok, o.seed + 2);
    std::vector<token_t> prompt{demo::tokenizer::bos};
    const auto body = text.tokens(static_cast<std::size_t>(o.ctx / 2));
    prompt.insert(prompt.end(), body.begin(), body.end());
    std::vector<float> logits;
    eng.eval(cache, prompt, 0, 0, logits);
    pos_t n_past = static_cast<pos_t>(prompt.size());
    demo::sampler smp(o.temperature, o.seed + 2);
    bool ok = true;
    int shifts = 0;
    std::string sample_text;
    token_t last = -1;
    const auto t0 = clock_type::now();
    for (int i = 0; i < o.n_gen; ++i) {
        const token_t t = smp.sample(logits);
        const token_t prev = i == 0 ? prompt.back() : last;
        last = t;
        for (char ch : tok.piece(prev, t))
            if (sample_text.size() < 60) sample_text += std::isprint(static_cast<unsigned char>(ch)) ? ch : '.';
        if (n_past + 1 >= o.ctx) {
            // kvcache::ops::context_shift, the K-shift, and the checks: the sequence holds exactly
            // positions [0, n_past) once each, every moved cell's K is a direct RoPE of its old K.
            const pos_t before = n_past;
            const shift_step st = context_shift_step(cache, 0, o.n_keep);
            n_past = st.plan.n_past_after;
            ++shifts;
            ok = ok && st.kshift_ok && st.contiguous;
            std::printf("  shift %2d at token %5d: n_past %d -> %d (keep %d, discard %d), cells used %u/%u, "
                        "buffer %zu bytes, K-shift error %.0e%s%s\n",
                        shifts, i, before, n_past, st.plan.n_keep, st.plan.n_discard, cache.used(), cache.capacity(),
                        cache.total_bytes(), st.kshift.max_error, st.contiguous ? "" : "  POSITIONS WRONG",
                        st.kshift_ok ? "" : "  K-SHIFT WRONG");
        }
        const std::vector<token_t> one{t};
        eng.eval(cache, one, n_past, 0, logits);
        ++n_past;
        for (float v : logits) ok = ok && std::isfinite(v);
        ok = ok && cache.total_bytes() == bytes && cache.used() <= cache.capacity();
    }
    const double ms = ms_since(t0);
    const bool must_shift = prompt.size() + static_cast<std::size_t>(o.n_gen) >= static_cast<std::size_t>(o.ctx);
    const bool pass = ok && (shifts > 0 || !must_shift);
    std::printf("  generated %d tokens (%.1f ms/token) through %d context shifts; memory constant at %zu bytes; "
                "sample: \"%s\"\n  context shift: %s\n",
                o.n_gen, ms / o.n_gen, shifts, bytes, sample_text.c_str(), pass ? "PASS" : "FAIL");
    char summary[200];
    std::snprintf(summary, sizeof summary,
                  "n_ctx %d, n_keep %d: %d tokens generated through %d shifts, positions and K-shift checked after "
                  "each, K/V buffer constant at %zu bytes",
                  o.ctx, o.n_keep, o.n_gen, shifts, bytes);
    return {"context shift (F13)", summary, pass};
}

// ------------------------------------------------------------------------- Self-Extend

/// F14: a prompt longer than the "trained" window, evaluated in batches with the seed's
/// ga_n / ga_w loop before each batch; then generation. Checks the positions against
/// the closed form (self_extend_closed_form).
inline check_result run_self_extend(const demo::llama_weights& w, const demo::tokenizer& tok, const options& o) {
    const int n_prompt = 4 * o.ga_w, batch = 64, n_gen = 32;
    std::printf("\n== Self-Extend (F14): ga_n %d, ga_w %d, %d prompt tokens in batches of %d, %d generated\n", o.ga_n,
                o.ga_w, n_prompt, batch, n_gen);
    kvcache::ops::self_extend_state se{o.ga_n, o.ga_w, 0};
    demo::llama_engine<plain_cache> eng(w);
    plain_cache cache(eng.cache_shape(static_cast<std::uint32_t>(n_prompt + n_gen + batch), 1));
    text_source text(tok, o.seed + 3);
    std::vector<token_t> prompt{demo::tokenizer::bos};
    const auto body = text.tokens(static_cast<std::size_t>(n_prompt - 1));
    prompt.insert(prompt.end(), body.begin(), body.end());
    std::vector<float> logits;
    pos_t n_past = 0;
    int added = 0;
    const auto t0 = clock_type::now();
    // Every Self-Extend step (kvcache::ops::self_extend) moves cells with seq_add and seq_div;
    // the K-shift must rotate each moved cell's K by (new position - old position). Checked on
    // every step against a direct RoPE of the K before the step.
    demo::k_shift_report worst;
    auto extend = [&](pos_t past) { return self_extend_step(cache, 0, se, past, worst); };
    while (added < n_prompt) {
        n_past = extend(n_past);
        const int n = std::min(batch, n_prompt - added);
        eng.eval(cache, std::span<const token_t>(prompt).subspan(static_cast<std::size_t>(added), static_cast<std::size_t>(n)),
                 n_past, 0, logits);
        n_past += n;
        added += n;
    }
    demo::sampler greedy(0.0f, 0);
    for (int i = 0; i < n_gen; ++i) {
        const std::vector<token_t> one{greedy.sample(logits)};
        n_past = extend(n_past);
        eng.eval(cache, one, n_past, 0, logits);
        ++n_past;
        ++added;
    }
    n_past = extend(n_past);
    const double ms = ms_since(t0);
    // Compare the sequence's positions with the closed form.
    std::map<pos_t, std::uint32_t> want;
    for (int p = 0; p < added; ++p) ++want[self_extend_closed_form(se, p)];
    const bool positions_ok = cache.cells().seq_positions(0) == want;
    const bool n_past_ok = n_past == added - (o.ga_n - 1) * se.ga_i;
    bool finite = true;
    for (float v : logits) finite = finite && std::isfinite(v);
    const pos_t max_pos = cache.seq_pos_max(0);
    const bool kshift_ok = worst.max_error <= kshift_tol && worst.n_moved > 0;
    // Self-Extend exists to keep positions inside the trained context.
    const bool in_context = max_pos < w.config.seq_len;
    if (!in_context)
        std::printf("  positions reach %d, beyond the model's trained context %d: use a smaller --ga-w\n", max_pos,
                    w.config.seq_len);
    const bool pass = positions_ok && n_past_ok && finite && kshift_ok && in_context;
    std::printf("  %d tokens now span positions [0, %d] (ga_i %d): grouped by %d below %d, shifted by %d above; "
                "positions match the formula: %s; n_past %d: %s;\n  K-shift after seq_add/seq_div vs direct RoPE "
                "at the new positions: max error %.1e over %zu cell moves (%.0f ms)\n  Self-Extend: %s\n",
                added, max_pos, se.ga_i, o.ga_n, o.ga_n * se.ga_i, -(o.ga_n - 1) * se.ga_i,
                positions_ok ? "yes" : "NO", n_past, n_past_ok ? "ok" : "WRONG", worst.max_error, worst.n_moved, ms,
                pass ? "PASS" : "FAIL");
    char summary[200];
    std::snprintf(summary, sizeof summary,
                  "ga_n %d, ga_w %d: %d tokens in positions [0, %d], positions %s the closed form, K-shift error %.0e",
                  o.ga_n, o.ga_w, added, max_pos, positions_ok ? "match" : "DO NOT match", worst.max_error);
    return {"Self-Extend (F14)", summary, pass};
}

}  // namespace demo::scenarios
