// kvcache tier: tier_cache, a chain of storage tiers (memory -> disk -> Redis ...) under
// the global prompt cache, as policies.
//
// publish(mem, seq, tokens, salt) saves the sequence's K/V (io::save_seq) as a blob under
// the key of the longest block-aligned prefix of its tokens (tier/key.hpp), subject to the
// admission policy (always, or from the second sighting of that key), and writes it to
// every tier (write_through) or to the first only, the others on flush() (write_back).
// fetch(mem, dst, request, salt) probes the keys of the request's block-aligned prefixes
// from the longest to the shortest, each in tier order; the first blob that verifies
// (tier/blob.hpp: checksum, key, fingerprint, tenant, tokens) and loads (io::load_seq,
// which validates the state again) wins, is cut to its common prefix with the request and
// promoted into the tiers above the one that held it: at once (promotion::immediate) or
// queued and written by promote_pending() / flush() (promotion::deferred: the copy into the
// upper tiers leaves the request path). A tier with map() (disk_tier, memory_tier) is read
// in place, the verification and load straight from its mapping. A refused blob is erased from its
// tier and counted by reason; the request then goes on with the next candidate, so a
// collision, another model's or tenant's blob, or corrupt bytes is a miss, never wrong K/V.
// Each tier evicts by its own byte limit (LRU).
// Thread safety: not thread-safe; use one tier_cache with its memory from one thread at a
// time. Processes share the tiers that are shared by nature (disk directory, Redis).
#pragma once

#include <algorithm>    // std::max
#include <concepts>     // std::same_as
#include <cstddef>      // std::size_t
#include <cstdint>      // fixed-width integers
#include <cstring>      // std::memcpy
#include <deque>        // sightings, pending promotions, oldest first
#include <optional>     // fetch's promotion override
#include <span>         // labels
#include <string>       // Prometheus text
#include <string_view>  // names
#include <tuple>        // the tiers
#include <type_traits>  // std::remove_reference_t
#include <unordered_set>  // sightings
#include <utility>      // std::index_sequence
#include <variant>      // a pending promotion's bytes
#include <vector>       // keys, blob scratch

#include "../error.hpp"
#include "../io/hybrid.hpp"     // io::save_seq / load_seq of hybrid_memory
#include "../io/recurrent.hpp"  // ... and of recurrent_memory
#include "../io/state.hpp"
#include "../memory/memory.hpp"
#include "../memory/recurrent.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "blob.hpp"
#include "key.hpp"
#include "tier.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace tier {

/// Which published entries the tiers take.
enum class admission : std::uint8_t {
    always,           ///< every publish
    second_sighting,  ///< a key published for the second time (one-off prompts stay out)
};
/// How a publish reaches the lower tiers.
enum class write_mode : std::uint8_t {
    write_through,  ///< every tier at once
    write_back,     ///< the first tier at once, the others on flush()
};

/// When a blob found in a lower tier is written into the tiers above it.
enum class promotion : std::uint8_t {
    immediate,  ///< inside fetch(), before it returns
    deferred,   ///< queued (bounded by max_pending_bytes) and written by promote_pending() / flush()
};

/// Options of a tier_cache.
struct tier_cache_options {
    /// Positions per key block; a prefix is found in the tiers at multiples of it.
    std::uint32_t block_tokens = 64;
    admission admit = admission::always;
    write_mode write = write_mode::write_through;
    /// Keys remembered for admission::second_sighting (oldest forgotten first).
    std::size_t sightings_memory = std::size_t{1} << 16;
    /// Promotion of a lower-tier hit (fetch() may override it per call).
    promotion promote = promotion::immediate;
    /// Bytes of deferred promotions queued at most; a promotion that would exceed it is
    /// dropped (counted: promotions_dropped). A queued promotion holds its blob (a disk
    /// tier's mapping, or a copy in memory) until promote_pending() runs.
    std::size_t max_pending_bytes = std::size_t{256} << 20;
};

/// Counters of one tier inside a tier_cache.
struct tier_metrics {
    std::uint64_t probes = 0;       ///< gets of a key
    std::uint64_t hits = 0;         ///< blobs verified and loaded
    std::uint64_t misses = 0;       ///< gets that found nothing (or an unreachable store)
    std::uint64_t refused[n_refusals] = {};  ///< blobs found but not used, per refusal ([0] unused)
    std::uint64_t puts = 0;         ///< blobs written
    std::uint64_t put_failures = 0; ///< writes the tier refused (no room, I/O, server down)
    std::uint64_t promotions = 0;   ///< blobs written here because a lower tier hit
    std::uint64_t bytes_read = 0;   ///< bytes of the blobs got
    std::uint64_t bytes_written = 0;  ///< bytes of the blobs put
    std::size_t bytes = 0;          ///< bytes the tier holds (tier.bytes())
    [[nodiscard]] std::uint64_t refused_for(refusal r) const noexcept { return refused[static_cast<std::size_t>(r)]; }
};

/// Counters of a tier_cache: the requests, then one tier_metrics per tier in chain order.
struct tier_cache_metrics {
    std::uint64_t publishes = 0;          ///< publish calls
    std::uint64_t published = 0;          ///< entries written to the first tier
    std::uint64_t too_short = 0;          ///< publishes shorter than one block
    std::uint64_t admission_skipped = 0;  ///< publishes the admission policy kept out
    std::uint64_t already_held = 0;       ///< publishes whose key the first tier held
    std::uint64_t fetches = 0;            ///< fetch calls
    std::uint64_t fetch_hits = 0;         ///< fetches that loaded an entry
    std::uint64_t hit_tokens = 0;         ///< positions loaded by those fetches
    std::uint64_t promotions_deferred = 0;  ///< promotions queued (promotion::deferred)
    std::uint64_t promotions_dropped = 0;   ///< deferred promotions dropped: max_pending_bytes reached
    std::size_t pending_promotions = 0;     ///< promotions queued now
    std::size_t pending_bytes = 0;          ///< bytes of the promotions queued now
    std::vector<std::string> names;       ///< tier names, chain order
    std::vector<tier_metrics> tiers;      ///< per tier, chain order
};

namespace detail {
inline bool prom_ok(std::string_view n) noexcept {
    if (n.empty()) return false;
    for (std::size_t i = 0; i < n.size(); ++i) {
        const char c = n[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (i > 0 && c >= '0' && c <= '9'))) return false;
    }
    return true;
}
}  // namespace detail

/// Renders the counters in the Prometheus text format (0.0.4), names starting with
/// `prefix` (kvcache_tier_hits_total{tier="disk"} ...), each sample with the label pairs
/// `labels` ("name", "value"; values must not need escaping). Throws invalid_argument for
/// an invalid prefix or label name.
inline std::string to_prometheus(const tier_cache_metrics& m, std::string_view prefix = "kvcache",
                                 std::span<const std::pair<std::string, std::string>> labels = {}) {
    if (!detail::prom_ok(prefix))
        kvcache::detail::fail(errc::invalid_argument, "tier::to_prometheus: prefix = \"" + std::string(prefix) + "\" is not a metric name");
    std::string base;
    for (const auto& [n, v] : labels) {
        if (!detail::prom_ok(n) || n.starts_with("__") || v.find_first_of("\\\"\n") != std::string::npos)
            kvcache::detail::fail(errc::invalid_argument, "tier::to_prometheus: label " + n + " is not valid");
        base += n + "=\"" + v + "\",";
    }
    std::string out;
    auto head = [&](std::string_view name, std::string_view type, std::string_view help) {
        out += "# HELP " + std::string(prefix) + "_" + std::string(name) + " " + std::string(help) + "\n# TYPE " +
               std::string(prefix) + "_" + std::string(name) + " " + std::string(type) + "\n";
    };
    auto sample = [&](std::string_view name, const std::string& label, std::uint64_t v) {
        std::string l = base + label;
        if (!l.empty() && l.back() == ',') l.pop_back();
        out += std::string(prefix) + "_" + std::string(name) + (l.empty() ? "" : "{" + l + "}") + " " + std::to_string(v) + "\n";
    };
    auto one = [&](std::string_view name, std::string_view help, std::uint64_t v) {
        head(name, "counter", help);
        sample(name, "", v);
    };
    one("tier_publishes_total", "Entries offered to the storage tiers.", m.publishes);
    one("tier_published_total", "Entries written to the first storage tier.", m.published);
    one("tier_admission_skipped_total", "Entries the admission policy kept out of the tiers.", m.admission_skipped);
    one("tier_fetches_total", "Lookups of the storage tiers.", m.fetches);
    one("tier_fetch_hits_total", "Lookups that loaded an entry from a storage tier.", m.fetch_hits);
    one("tier_hit_tokens_total", "Positions loaded from the storage tiers.", m.hit_tokens);
    one("tier_promotions_deferred_total", "Promotions queued for promote_pending().", m.promotions_deferred);
    one("tier_promotions_dropped_total", "Deferred promotions dropped: the pending byte bound was reached.", m.promotions_dropped);
    head("tier_pending_promotions", "gauge", "Promotions queued now.");
    sample("tier_pending_promotions", "", m.pending_promotions);
    head("tier_pending_promotion_bytes", "gauge", "Bytes of the promotions queued now.");
    sample("tier_pending_promotion_bytes", "", m.pending_bytes);
    auto per_tier = [&](std::string_view name, std::string_view type, std::string_view help, auto field) {
        head(name, type, help);
        for (std::size_t t = 0; t < m.tiers.size(); ++t) sample(name, "tier=\"" + m.names[t] + "\"", field(m.tiers[t]));
    };
    per_tier("tier_probes_total", "counter", "Gets of a key, per tier.", [](const tier_metrics& t) { return t.probes; });
    per_tier("tier_hits_total", "counter", "Blobs verified and loaded, per tier.", [](const tier_metrics& t) { return t.hits; });
    per_tier("tier_misses_total", "counter", "Gets that found nothing, per tier.", [](const tier_metrics& t) { return t.misses; });
    head("tier_refused_total", "counter", "Blobs found but refused by verification or load, per tier and reason.");
    for (std::size_t t = 0; t < m.tiers.size(); ++t)
        for (std::size_t r = 1; r < n_refusals; ++r)
            sample("tier_refused_total",
                   "tier=\"" + m.names[t] + "\",reason=\"" + to_string(static_cast<refusal>(r)) + "\"", m.tiers[t].refused[r]);
    per_tier("tier_puts_total", "counter", "Blobs written, per tier.", [](const tier_metrics& t) { return t.puts; });
    per_tier("tier_put_failures_total", "counter", "Blob writes refused, per tier.", [](const tier_metrics& t) { return t.put_failures; });
    per_tier("tier_promotions_total", "counter", "Blobs copied up after a lower tier hit, per tier.", [](const tier_metrics& t) { return t.promotions; });
    per_tier("tier_read_bytes_total", "counter", "Bytes of blobs read, per tier.", [](const tier_metrics& t) { return t.bytes_read; });
    per_tier("tier_written_bytes_total", "counter", "Bytes of blobs written, per tier.", [](const tier_metrics& t) { return t.bytes_written; });
    per_tier("tier_bytes", "gauge", "Bytes held, per tier.", [](const tier_metrics& t) { return std::uint64_t{t.bytes}; });
    return out;
}

/// What a publish did.
struct publish_info {
    bool stored = false;          ///< written to the first tier now
    std::uint32_t key_tokens = 0; ///< positions the key covers (0: shorter than a block)
};
/// What a fetch found.
struct fetch_info {
    std::uint32_t n_tokens = 0;  ///< positions loaded into dst (0: a miss)
    int tier = -1;               ///< index of the tier that held the blob (-1: a miss)
    /// Positions of the longest blob that verified but found no room in the memory (0:
    /// none); the fetch went on with shorter candidates. Make room and fetch again to load it.
    std::uint32_t no_room = 0;
};

/// A chain of storage tiers, first = fastest (see above).
template <class Memory, storage_tier... Tiers>
class tier_cache {
    static_assert(memory<Memory>, "kvcache: tier_cache<Memory, ...> needs a kvcache::memory");
    static_assert(sizeof...(Tiers) >= 1, "kvcache: tier_cache needs at least one storage tier");

public:
    using memory_type = Memory;
    static constexpr std::size_t n_tiers = sizeof...(Tiers);
    /// Whether a loaded blob can be cut to a shorter prefix. A recurrent state
    /// (recurrent_memory, hybrid_memory) cannot be rolled back: fetch() takes only a blob
    /// whose whole length fits (its common prefix with the request and max_tokens cover all
    /// of it); a longer one is a miss (not a refusal) and the next candidate is tried.
    static constexpr bool can_cut = !(std::same_as<Memory, recurrent_memory> ||
                                      requires(const Memory& m) { m.recurrent(); });

    /// Throws invalid_argument for block_tokens = 0.
    explicit tier_cache(tier_cache_options opt, Tiers... tiers) : opt_(opt), tiers_(std::move(tiers)...) {
        if (opt_.block_tokens == 0) kvcache::detail::fail(errc::invalid_argument, "tier_cache: block_tokens = 0, must be >= 1");
        metrics_.tiers.resize(n_tiers);
        for_each([&](auto& t, std::size_t i) {
            metrics_.names.emplace_back(t.name());
            static_cast<void>(i);
            return false;
        });
    }

    /// Tier I of the chain.
    template <std::size_t I>
    [[nodiscard]] auto& get() noexcept { return std::get<I>(tiers_); }
    [[nodiscard]] const tier_cache_options& options() const noexcept { return opt_; }

    /// Offers sequence seq of mem, holding `tokens` (positions 0 .. tokens.size() - 1), to
    /// the tiers under the key of its longest block-aligned prefix. Throws invalid_argument
    /// when seq does not hold tokens.size() positions. A tier's refusal is counted
    /// (put_failures) and does not stop the others.
    publish_info publish(const Memory& mem, seq_id_t seq, const prompt_tokens& tokens, std::uint64_t salt = 0) {
        ++metrics_.publishes;
        if (static_cast<std::int64_t>(mem.seq_pos_max(seq)) + 1 != static_cast<std::int64_t>(tokens.size()))
            kvcache::detail::fail(errc::invalid_argument, "tier_cache::publish: sequence " + std::to_string(seq) +
                                                              " ends at position " + std::to_string(mem.seq_pos_max(seq)) +
                                                              ", tokens.size() = " + std::to_string(tokens.size()));
        const sha256_digest fp = memory_fingerprint(mem);
        const auto keys = block_keys(tokens, opt_.block_tokens, fp, salt);
        if (keys.empty()) {
            ++metrics_.too_short;
            return {};
        }
        const prefix_key& pk = keys.back();
        publish_info info{false, pk.n_tokens};
        if (opt_.admit == admission::second_sighting && !sighted(pk.k)) {
            ++metrics_.admission_skipped;
            return info;
        }
        if (std::get<0>(tiers_).contains(pk.k)) {
            ++metrics_.already_held;
            return info;
        }
        const std::vector<std::byte> payload = io::save_seq(mem, seq);
        const std::vector<std::byte> blob = make_blob(pk.k, fp, salt, pk.n_tokens, tokens, payload);
        for_each([&](auto& t, std::size_t i) {
            if (i > 0 && opt_.write == write_mode::write_back) return true;
            const bool ok = put_into(t, i, pk.k, blob);
            if (i == 0) info.stored = ok;
            return false;
        });
        if (info.stored) ++metrics_.published;
        if (opt_.write == write_mode::write_back && n_tiers > 1) pending_.push_back(pk.k);
        return info;
    }

    /// Runs the deferred promotions (promote_pending()), then writes the entries published
    /// since the last flush (write_back) to the lower tiers, from the first tier (entries it
    /// evicted meanwhile are lost). Returns the write_back entries written.
    std::size_t flush() {
        static_cast<void>(promote_pending());
        std::size_t n = 0;
        for (const key& k : pending_) {
            if (!std::get<0>(tiers_).get(k, scratch_)) continue;
            ++n;
            for_each([&](auto& t, std::size_t i) {
                if (i > 0) put_into(t, i, k, scratch_);
                return false;
            });
        }
        pending_.clear();
        return n;
    }

    /// Loads into the empty sequence dst the longest block-aligned prefix of `request`
    /// (tenant salt) some tier holds, extended to the blob's common prefix with the request,
    /// then capped at max_tokens positions (and cut back to the start of a media chunk the
    /// cap falls into); on a memory with recurrent state only whole blobs (see can_cut). A miss (n_tokens = 0)
    /// leaves mem unchanged. Throws invalid_argument when dst is not empty,
    /// transaction_open while placements are staged. promote: this call's promotion of a
    /// lower-tier hit (default: options().promote).
    fetch_info fetch(Memory& mem, seq_id_t dst, const prompt_tokens& request, std::uint64_t salt = 0,
                     std::size_t max_tokens = SIZE_MAX, std::optional<promotion> promote = std::nullopt) {
        const promotion mode = promote.value_or(opt_.promote);
        ++metrics_.fetches;
        if (mem.in_transaction())
            kvcache::detail::fail(errc::transaction_open, "tier_cache::fetch: placements are staged; commit() or restore() first");
        if (mem.seq_pos_max(dst) >= 0)
            kvcache::detail::fail(errc::invalid_argument, "tier_cache::fetch: destination sequence " + std::to_string(dst) +
                                                              " is not empty");
        const sha256_digest fp = memory_fingerprint(mem);
        // Every key of the request, also beyond max_tokens: an entry keyed at n serves a
        // request of n positions capped at n - 1 (the usual cap: the last position's logits).
        const auto keys = block_keys(request, opt_.block_tokens, fp, salt);
        std::uint32_t no_room = 0;
        for (std::size_t j = keys.size(); j-- > 0;) {
            const prefix_key& pk = keys[j];
            fetch_info found;
            for_each([&](auto& t, std::size_t i) {
                tier_metrics& tm = metrics_.tiers[i];
                ++tm.probes;
                mapped_blob mapped;  // a tier with map(): the blob in place
                std::span<const std::byte> bytes;
                if constexpr (mappable_tier<std::remove_reference_t<decltype(t)>>) {
                    if (!t.map(pk.k, mapped)) {
                        ++tm.misses;
                        return false;
                    }
                    bytes = mapped.bytes();
                } else {
                    if (!t.get(pk.k, scratch_)) {
                        ++tm.misses;
                        return false;
                    }
                    bytes = scratch_;
                }
                tm.bytes_read += bytes.size();
                blob_view v;
                const refusal r = verify_blob(bytes, pk.k, pk.n_tokens, fp, salt, request, v);
                if (r != refusal::none) {
                    ++tm.refused[static_cast<std::size_t>(r)];
                    mapped.reset();
                    t.erase(pk.k);
                    tm.bytes = t.bytes();
                    return false;
                }
                std::size_t lcp = std::min(v.tokens.common_prefix(request), max_tokens);
                // max_tokens may fall inside a media chunk: keep none of it.
                if (const media_chunk* mc = request.chunk_at(lcp); mc != nullptr && mc->begin < lcp) lcp = mc->begin;
                if (lcp == 0 || (!can_cut && lcp < v.tokens.size())) {
                    ++tm.misses;  // found, but the cap leaves nothing of it (or a state that cannot be cut)
                    return false;
                }
                if (const errc e = load_prefix(mem, dst, v.payload, lcp, v.tokens.size()); e != errc::ok) {
                    ++tm.refused[static_cast<std::size_t>(refusal::load)];
                    if (e == errc::no_space) no_room = std::max(no_room, static_cast<std::uint32_t>(v.tokens.size()));
                    return false;
                }
                ++tm.hits;
                found = fetch_info{static_cast<std::uint32_t>(lcp), static_cast<int>(i)};
                if (i > 0) promote_hit(i, pk.k, mode, std::move(mapped), bytes);
                return true;
            });
            if (found.n_tokens > 0) {
                ++metrics_.fetch_hits;
                metrics_.hit_tokens += found.n_tokens;
                found.no_room = no_room;
                return found;
            }
        }
        fetch_info miss;
        miss.no_room = no_room;
        return miss;
    }

    /// The host hook under a slot manager: sequence seq holds the first have_n positions of
    /// `request` (what slot_manager::prepare kept). Fetches the request into the empty
    /// sequence `scratch` (reserved by the host, never a slot's) and, when the tiers give
    /// more than have_n positions, makes seq hold those instead (seq_rm, seq_cp from scratch);
    /// scratch is empty again afterwards. Returns the positions seq holds: compute the request
    /// from there, then commit_prompt. On a miss or a shorter hit seq keeps its have_n
    /// positions; a layout refusing the copy (seq_cp) leaves seq empty (returns 0). Throws as fetch() (scratch not empty), and
    /// invalid_argument when seq does not end at have_n - 1.
    std::uint32_t fetch_longer(Memory& mem, seq_id_t seq, std::uint32_t have_n, const prompt_tokens& request,
                               seq_id_t scratch, std::uint64_t salt = 0, std::size_t max_tokens = SIZE_MAX,
                               std::optional<promotion> promote = std::nullopt) {
        if (static_cast<std::int64_t>(mem.seq_pos_max(seq)) + 1 != static_cast<std::int64_t>(have_n))
            kvcache::detail::fail(errc::invalid_argument, "tier_cache::fetch_longer: sequence " + std::to_string(seq) +
                                                              " ends at " + std::to_string(mem.seq_pos_max(seq)) +
                                                              ", have_n = " + std::to_string(have_n));
        const fetch_info f = fetch(mem, scratch, request, salt, max_tokens, promote);
        std::uint32_t out = have_n;
        if (f.n_tokens > have_n) {
            static_cast<void>(mem.seq_rm(seq, -1, -1));  // the whole sequence: never refused
            out = mem.seq_cp(scratch, seq, -1, -1) ? f.n_tokens : 0;
        }
        static_cast<void>(mem.seq_rm(scratch, -1, -1));
        return out;
    }

    /// Writes the queued (deferred) promotions into the tiers above the one each came from,
    /// oldest first, skipping a tier that holds the key by now; a tier's refusal is counted
    /// (put_failures). Returns the promotions run. When a put throws (std::bad_alloc) that
    /// promotion is dropped, the rest stay queued.
    std::size_t promote_pending() {
        std::size_t n = 0;
        while (!pending_promos_.empty()) {
            pending_promotion p = std::move(pending_promos_.front());
            pending_promos_.pop_front();
            pending_bytes_ -= p.size;
            ++n;
            auto* vec = std::get_if<std::vector<std::byte>>(&p.bytes);
            const std::span<const std::byte> b =
                vec != nullptr ? std::span<const std::byte>(*vec) : std::get<mapped_blob>(p.bytes).bytes();
            // The tiers above the source, the first one last: it may take the vector itself.
            for_each_reverse([&](auto& up, std::size_t u) {
                if (u >= p.from || up.contains(p.k)) return;
                const bool ok = u == 0 && vec != nullptr ? put_into(up, u, p.k, std::move(*vec), b.size())
                                                         : put_into(up, u, p.k, b);
                if (ok) ++metrics_.tiers[u].promotions;
            });
        }
        return n;
    }

    /// Counters, with each tier's bytes() now.
    [[nodiscard]] tier_cache_metrics metrics() {
        metrics_.pending_promotions = pending_promos_.size();
        metrics_.pending_bytes = pending_bytes_;
        for_each([&](auto& t, std::size_t i) {
            metrics_.tiers[i].bytes = t.bytes();
            return false;
        });
        return metrics_;
    }

private:
    /// Calls f(tier, index) in chain order until it returns true.
    template <class F>
    void for_each(F&& f) {
        [&]<std::size_t... I>(std::index_sequence<I...>) {
            static_cast<void>((f(std::get<I>(tiers_), I) || ...));
        }(std::index_sequence_for<Tiers...>{});
    }

    /// Calls f(tier, index) for every tier, last first.
    template <class F>
    void for_each_reverse(F&& f) {
        [&]<std::size_t... I>(std::index_sequence<I...>) {
            constexpr std::size_t last = sizeof...(I) - 1;
            (f(std::get<last - I>(tiers_), last - I), ...);
        }(std::index_sequence_for<Tiers...>{});
    }

    /// The promotion of a hit in tier from > 0: `bytes`, held by `mapped` (a mapping or
    /// lent bytes) or by scratch_ (mapped empty).
    void promote_hit(std::size_t from, const key& k, promotion mode, mapped_blob mapped, std::span<const std::byte> bytes) {
        if (mode == promotion::immediate) {
            for_each([&](auto& up, std::size_t u) {
                if (u >= from) return true;
                if (put_into(up, u, k, bytes)) ++metrics_.tiers[u].promotions;
                return false;
            });
            return;
        }
        for (const pending_promotion& p : pending_promos_)
            if (p.k == k) return;  // queued already
        if (bytes.size() > opt_.max_pending_bytes || pending_bytes_ > opt_.max_pending_bytes - bytes.size()) {
            ++metrics_.promotions_dropped;
            return;
        }
        std::variant<std::vector<std::byte>, mapped_blob> held;
        if (mapped.owns()) {
            held = std::move(mapped);  // the mapping itself: no copy
        } else if (bytes.data() == scratch_.data()) {
            held = std::exchange(scratch_, {});  // the buffer itself: no copy
        } else {
            std::vector<std::byte> copy;  // bytes a tier lent: valid only until it changes
            kvcache::detail::resize_blob_buffer(copy, bytes.size());
            if (!bytes.empty()) std::memcpy(copy.data(), bytes.data(), bytes.size());
            held = std::move(copy);
        }
        pending_promos_.push_back(pending_promotion{k, from, bytes.size(), std::move(held)});
        pending_bytes_ += bytes.size();
        ++metrics_.promotions_deferred;
    }

    template <class T>
    bool put_into(T& t, std::size_t i, const key& k, std::vector<std::byte>&& blob, std::size_t size) {
        tier_metrics& tm = metrics_.tiers[i];
        if (result<void> r = t.put(k, std::move(blob)); !r) {
            ++tm.put_failures;
            return false;
        }
        ++tm.puts;
        tm.bytes_written += size;
        tm.bytes = t.bytes();
        return true;
    }
    template <class T>
    bool put_into(T& t, std::size_t i, const key& k, std::span<const std::byte> blob) {
        tier_metrics& tm = metrics_.tiers[i];
        if (result<void> r = t.put(k, blob); !r) {
            ++tm.put_failures;
            return false;
        }
        ++tm.puts;
        tm.bytes_written += blob.size();
        tm.bytes = t.bytes();
        return true;
    }

    /// Loads payload into the empty dst and keeps its first keep of n positions; on any
    /// refusal (its code: no_space when the memory had no room) dst is empty again and mem
    /// as before.
    static errc load_prefix(Memory& mem, seq_id_t dst, std::span<const std::byte> payload, std::size_t keep, std::size_t n) {
        if (const auto r = io::load_seq(mem, dst, payload); !r) return r.code();
        if (static_cast<std::int64_t>(mem.seq_pos_max(dst)) + 1 != static_cast<std::int64_t>(n) ||
            (keep < n && !mem.seq_rm(dst, static_cast<pos_t>(keep), -1))) {
            static_cast<void>(mem.seq_rm(dst, -1, -1));
            return errc::unsupported;  // the layout refused the cut
        }
        return errc::ok;
    }

    /// Whether k was offered before (records it otherwise).
    bool sighted(const key& k) {
        if (seen_.contains(k)) return true;
        seen_.insert(k);
        seen_order_.push_back(k);
        while (seen_order_.size() > opt_.sightings_memory) {
            seen_.erase(seen_order_.front());
            seen_order_.pop_front();
        }
        return false;
    }

    tier_cache_options opt_;
    std::tuple<Tiers...> tiers_;
    tier_cache_metrics metrics_;
    std::vector<std::byte> scratch_;  // the blob being got
    std::vector<key> pending_;        // write_back: published since the last flush
    struct pending_promotion {
        key k;
        std::size_t from = 0;  // the tier that held the blob
        std::size_t size = 0;
        std::variant<std::vector<std::byte>, mapped_blob> bytes;
    };
    std::deque<pending_promotion> pending_promos_;  // promotion::deferred, oldest first
    std::size_t pending_bytes_ = 0;
    std::unordered_set<key, key_hash> seen_;
    std::deque<key> seen_order_;
};

}  // namespace tier
KVCACHE_END_NAMESPACE
