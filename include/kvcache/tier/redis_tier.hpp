// kvcache tier: redis_tier, blobs in Redis (standalone or Redis Cluster) shared by every
// process and machine pointed at the same server.
//
// Needs hiredis (Debian libhiredis-dev; link -lhiredis). Not included by kvcache.hpp;
// without <hiredis/hiredis.h> this header declares nothing and defines
// KVCACHE_HAS_REDIS_TIER to 0 (1 otherwise); define KVCACHE_NO_REDIS_TIER to leave it out.
//
// Values: one Redis string per entry, "<prefix><key hex>" -> blob, written with
// SET key blob PX ttl_ms (ttl_ms = 0: no expiry; Redis's own maxmemory policy may also
// evict: an evicted entry is a miss). A blob longer than chunk_bytes is stored as chunks
// "<prefix><key hex>#<i>" (i = 0, 1, ...; each chunk_bytes long, the last shorter, each
// routed by its own key in a cluster) written first, then under the entry's key a 24-byte
// manifest ("KVRC", version 1, total bytes, chunk bytes; little-endian) that get() follows.
// Chunks keep every buffer of the client (and the server's allocations) at chunk size: a
// 32 MiB value costs several fresh 32 MiB buffers per call otherwise, and first-touch page
// faults then dominate (measured: bench/README.md). A missing, expired or evicted chunk, or
// one of the wrong length, is a miss; chunks of two writers mixed are caught by the blob's
// checksum (tier_cache). Writes are pipelined: put() queues a SET and sends
// the queue when it holds `pipeline` commands, before any read, and on sync(); a write
// that fails later is counted (stats().put_failures), never reported to the caller, like
// any cache write that is lost.
// Failures: every connect and every call has a timeout (connect_timeout_ms,
// io_timeout_ms: redisConnectWithTimeout, redisSetTimeout). A node that fails or times out
// is marked down for a backoff (backoff_min_ms, doubling up to backoff_max_ms, reset by a
// success); while down, calls to it return at once: get a miss, put a failure. So Redis
// down, slow or restarted costs at most one timeout per backoff period, never a hang or an
// exception.
// Cluster (options.cluster): keys map to the 16384 hash slots by CRC-16/XMODEM of the key
// (or of its {hash tag}) as the Redis Cluster specification defines; the slot map comes
// from CLUSTER SLOTS of any seed or known node (at start and after a MOVED reply); MOVED
// sends the command to the named node and refreshes the map, ASK sends ASKING and the
// command to the named node once; at most max_redirects redirects per command.
// Thread safety: not thread-safe (one redis_tier per thread; connections are not shared).
#pragma once

#if !defined(KVCACHE_NO_REDIS_TIER) && __has_include(<hiredis/hiredis.h>)
#define KVCACHE_HAS_REDIS_TIER 1

#include <hiredis/hiredis.h>
#include <sys/time.h>  // timeval

#include <algorithm>    // std::min
#include <array>        // slot map
#include <cstdlib>      // std::atoi
#include <cstring>      // std::memcpy (manifest)
#include <initializer_list>  // command arguments
#include <chrono>       // backoff
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // fixed-width integers
#include <map>          // nodes by address
#include <memory>       // node ownership
#include <span>         // blob bytes
#include <string>       // keys, addresses
#include <string_view>  // name
#include <vector>       // pipeline, blob bytes

#include "../error.hpp"
#include "buffer.hpp"
#include "key.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace tier {

/// CRC-16/XMODEM (polynomial 0x1021, initial value 0), Redis Cluster's key hash:
/// crc16("123456789") = 0x31C3.
[[nodiscard]] constexpr std::uint16_t crc16_xmodem(std::string_view s) noexcept {
    std::uint16_t crc = 0;
    for (char ch : s) {
        crc = static_cast<std::uint16_t>(crc ^ (static_cast<std::uint16_t>(static_cast<unsigned char>(ch)) << 8));
        for (int i = 0; i < 8; ++i)
            crc = static_cast<std::uint16_t>((crc & 0x8000) ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc;
}
/// Redis Cluster hash slot of a key: CRC-16 of the key, or of the part between its first
/// '{' and the next '}' when that part is not empty, modulo 16384.
[[nodiscard]] constexpr std::uint16_t redis_slot(std::string_view k) noexcept {
    const std::size_t open = k.find('{');
    if (open != std::string_view::npos) {
        const std::size_t close = k.find('}', open + 1);
        if (close != std::string_view::npos && close > open + 1) k = k.substr(open + 1, close - open - 1);
    }
    return static_cast<std::uint16_t>(crc16_xmodem(k) & 16383u);
}

/// A Redis server address.
struct redis_endpoint {
    std::string host = "127.0.0.1";
    int port = 6379;
};

/// Options of a redis_tier.
struct redis_tier_options {
    std::vector<redis_endpoint> nodes = {redis_endpoint{}};  ///< the server, or cluster seed nodes
    bool cluster = false;          ///< Redis Cluster: hash slots, MOVED / ASK
    bool load_slots = true;        ///< cluster: read CLUSTER SLOTS at the first call (off: learn by MOVED)
    std::string prefix = "kvcache:";  ///< prepended to the key hex
    std::int64_t ttl_ms = 3600 * 1000;  ///< expiry of each entry; 0 = none
    int connect_timeout_ms = 200;
    int io_timeout_ms = 500;
    int backoff_min_ms = 100;
    int backoff_max_ms = 5000;
    std::size_t pipeline = 16;     ///< SETs queued before they are sent (1: each at once)
    std::size_t chunk_bytes = std::size_t{1} << 20;  ///< blobs longer than this are stored in chunks (0: never)
    int max_redirects = 5;
};

/// Counters of a redis_tier.
struct redis_tier_stats {
    std::uint64_t gets = 0, get_hits = 0, puts = 0, put_failures = 0;
    std::uint64_t errors = 0;          ///< failed or timed-out calls (the node then backs off)
    std::uint64_t skipped_down = 0;    ///< calls answered at once because the node was backing off
    std::uint64_t connects = 0;        ///< connections opened
    std::uint64_t moved = 0, ask = 0;  ///< cluster redirects followed
    std::uint64_t slot_refreshes = 0;  ///< CLUSTER SLOTS reads
};

/// Blobs in Redis (see above).
class redis_tier {
public:
    /// Throws invalid_argument without a node or with a non-positive timeout.
    explicit redis_tier(redis_tier_options opt) : opt_(std::move(opt)) {
        if (opt_.nodes.empty()) kvcache::detail::fail(errc::invalid_argument, "redis_tier: options.nodes is empty");
        if (opt_.connect_timeout_ms <= 0 || opt_.io_timeout_ms <= 0)
            kvcache::detail::fail(errc::invalid_argument, "redis_tier: timeouts must be > 0 ms");
        for (const redis_endpoint& e : opt_.nodes) node_of(e.host, e.port);
        slots_.fill(nullptr);
    }
    redis_tier(redis_tier&&) noexcept = default;
    redis_tier& operator=(redis_tier&&) noexcept = default;
    ~redis_tier() {
        if (!nodes_.empty()) sync();
    }

    /// Queues SET <prefix><hex> blob [PX ttl]; sent when the queue is full, before a read,
    /// or on sync(). Error io_error only when the node is down now.
    result<void> put(const key& k, std::span<const std::byte> blob) {
        const std::string rk = opt_.prefix + k.hex();
        if (opt_.chunk_bytes > 0 && blob.size() > opt_.chunk_bytes) {  // chunks first, the manifest last
            const std::size_t n_chunks = (blob.size() + opt_.chunk_bytes - 1) / opt_.chunk_bytes;
            for (std::size_t i = 0; i < n_chunks; ++i) {
                const std::size_t at = i * opt_.chunk_bytes;
                if (!enqueue(rk + "#" + std::to_string(i), blob.subspan(at, std::min(opt_.chunk_bytes, blob.size() - at))))
                    return down_error();
            }
            sync();  // every chunk sent before the manifest that points at them
            const manifest m = make_manifest(blob.size());
            if (!enqueue(rk, std::span<const std::byte>(m.data(), m.size()))) return down_error();
        } else if (!enqueue(rk, blob)) {
            return down_error();
        }
        ++stats_.puts;
        return {};
    }
    bool get(const key& k, std::vector<std::byte>& out) {
        ++stats_.gets;
        const std::string rk = opt_.prefix + k.hex();
        redisReply* r = command(rk, {"GET", rk});
        bool hit = r != nullptr && r->type == REDIS_REPLY_STRING;
        std::size_t total = 0, chunk = 0;
        if (hit && read_manifest(r, total, chunk)) {
            freeReplyObject(r);
            r = nullptr;
            hit = get_chunks(rk, total, chunk, out);
        } else if (hit) {
            kvcache::detail::resize_blob_buffer(out, r->len);
            if (r->len > 0) std::memcpy(out.data(), r->str, r->len);
        }
        if (hit) ++stats_.get_hits;
        if (r != nullptr) freeReplyObject(r);
        return hit;
    }
    bool contains(const key& k) {
        const std::string rk = opt_.prefix + k.hex();
        redisReply* r = command(rk, {"EXISTS", rk});
        const bool yes = r != nullptr && r->type == REDIS_REPLY_INTEGER && r->integer == 1;
        if (r != nullptr) freeReplyObject(r);
        return yes;
    }
    bool erase(const key& k) {
        const std::string rk = opt_.prefix + k.hex();
        if (redisReply* g = command(rk, {"GET", rk}); g != nullptr) {  // a manifest: its chunks go first
            std::size_t total = 0, chunk = 0;
            const bool chunked = g->type == REDIS_REPLY_STRING && read_manifest(g, total, chunk);
            freeReplyObject(g);
            for (std::size_t i = 0; chunked && i * chunk < total; ++i) {
                const std::string ck = rk + "#" + std::to_string(i);
                if (redisReply* d = command(ck, {"DEL", ck}); d != nullptr) freeReplyObject(d);
            }
        }
        redisReply* r = command(rk, {"DEL", rk});
        const bool yes = r != nullptr && r->type == REDIS_REPLY_INTEGER && r->integer == 1;
        if (r != nullptr) freeReplyObject(r);
        return yes;
    }
    /// Bytes this object wrote (the server's memory is its own business: INFO memory).
    [[nodiscard]] std::size_t bytes() const noexcept { return bytes_written_; }
    [[nodiscard]] std::string_view name() const noexcept { return "redis"; }
    [[nodiscard]] const redis_tier_stats& stats() const noexcept { return stats_; }

    /// Sends every queued SET and reads the replies (a MOVED or ASK reply is followed).
    void sync() {
        for (auto& [addr, n] : nodes_) send_queue(*n);
    }

private:
    using clock = std::chrono::steady_clock;
    struct pending {
        std::string key;
        std::vector<std::byte> blob;
    };
    struct node {
        std::string host;
        int port = 0;
        redisContext* ctx = nullptr;
        clock::time_point down_until{};
        int backoff_ms = 0;
        std::vector<pending> queue;
        ~node() {
            if (ctx != nullptr) redisFree(ctx);
        }
    };

    using manifest = std::array<std::byte, 24>;
    static constexpr char manifest_magic[4] = {'K', 'V', 'R', 'C'};

    manifest make_manifest(std::size_t total) const noexcept {
        manifest m{};
        const std::uint32_t version = 1;
        const std::uint64_t t = total, c = opt_.chunk_bytes;
        std::memcpy(m.data(), manifest_magic, 4);
        std::memcpy(m.data() + 4, &version, 4);  // little-endian hosts (x86-64, AArch64)
        std::memcpy(m.data() + 8, &t, 8);
        std::memcpy(m.data() + 16, &c, 8);
        return m;
    }
    /// Whether reply r is a manifest (then total and chunk are its fields).
    static bool read_manifest(const redisReply* r, std::size_t& total, std::size_t& chunk) noexcept {
        if (r->len != sizeof(manifest) || std::memcmp(r->str, manifest_magic, 4) != 0) return false;
        std::uint32_t version = 0;
        std::uint64_t t = 0, c = 0;
        std::memcpy(&version, r->str + 4, 4);
        std::memcpy(&t, r->str + 8, 8);
        std::memcpy(&c, r->str + 16, 8);
        if (version != 1 || c == 0 || t <= c || t / c > (std::uint64_t{1} << 24)) return false;
        total = static_cast<std::size_t>(t);
        chunk = static_cast<std::size_t>(c);
        return true;
    }
    /// Reads the chunks of a manifest's entry into out; false (a miss) when one is missing
    /// or has the wrong length.
    bool get_chunks(const std::string& rk, std::size_t total, std::size_t chunk, std::vector<std::byte>& out) {
        kvcache::detail::resize_blob_buffer(out, total);
        for (std::size_t i = 0, at = 0; at < total; ++i, at += chunk) {
            const std::string ck = rk + "#" + std::to_string(i);
            redisReply* r = command(ck, {"GET", ck});
            const std::size_t want = std::min(chunk, total - at);
            const bool good = r != nullptr && r->type == REDIS_REPLY_STRING && static_cast<std::size_t>(r->len) == want;
            if (good) std::memcpy(out.data() + at, r->str, want);
            if (r != nullptr) freeReplyObject(r);
            if (!good) return false;
        }
        return true;
    }
    /// Queues SET rk value on rk's node; false when the node is down.
    bool enqueue(const std::string& rk, std::span<const std::byte> value) {
        node* n = route(rk);
        if (n == nullptr || !usable(*n)) return false;
        n->queue.push_back(pending{rk, std::vector<std::byte>(value.begin(), value.end())});
        if (n->queue.size() >= opt_.pipeline) send_queue(*n);
        return true;
    }
    result<void> down_error() {
        ++stats_.put_failures;
        return kvcache::detail::make_error(errc::io_error, "redis_tier::put: node down (backing off)");
    }

    static timeval tv_of(int ms) noexcept { return timeval{ms / 1000, static_cast<suseconds_t>((ms % 1000) * 1000)}; }

    node* node_of(const std::string& host, int port) {
        const std::string addr = host + ":" + std::to_string(port);
        auto& slot = nodes_[addr];
        if (!slot) {
            slot = std::make_unique<node>();
            slot->host = host;
            slot->port = port;
        }
        return slot.get();
    }

    /// Whether n is connected or may be connected now (not backing off).
    bool usable(node& n) {
        if (n.ctx != nullptr) return true;
        if (clock::now() < n.down_until) {
            ++stats_.skipped_down;
            return false;
        }
        ++stats_.connects;
        n.ctx = redisConnectWithTimeout(n.host.c_str(), n.port, tv_of(opt_.connect_timeout_ms));
        if (n.ctx == nullptr || n.ctx->err != 0 || redisSetTimeout(n.ctx, tv_of(opt_.io_timeout_ms)) != REDIS_OK) {
            fail(n);
            return false;
        }
        n.ctx->reader->maxbuf = 0;  // keep the read buffer between replies (a chunk each): no regrowth
        return true;
    }
    /// The call on n failed: close, back off.
    void fail(node& n) {
        ++stats_.errors;
        if (n.ctx != nullptr) redisFree(n.ctx);
        n.ctx = nullptr;
        n.backoff_ms = n.backoff_ms == 0 ? opt_.backoff_min_ms : std::min(2 * n.backoff_ms, opt_.backoff_max_ms);
        n.down_until = clock::now() + std::chrono::milliseconds(n.backoff_ms);
        stats_.put_failures += n.queue.size();
        n.queue.clear();
    }
    void ok(node& n) noexcept { n.backoff_ms = 0; }

    /// The node serving key rk (cluster: by slot; unknown slot: the first seed).
    node* route(const std::string& rk) {
        if (!opt_.cluster) return first_seed();
        if (opt_.load_slots && !slots_loaded_) refresh_slots();
        node* n = slots_[redis_slot(rk)];
        return n != nullptr ? n : first_seed();
    }
    node* first_seed() { return node_of(opt_.nodes.front().host, opt_.nodes.front().port); }

    /// Reads CLUSTER SLOTS from the first node that answers.
    void refresh_slots() {
        slots_loaded_ = true;
        ++stats_.slot_refreshes;
        std::vector<node*> order;
        for (auto& [addr, n] : nodes_) order.push_back(n.get());
        for (node* n : order) {
            if (!usable(*n)) continue;
            send_queue(*n);
            if (n->ctx == nullptr) continue;
            auto* r = static_cast<redisReply*>(redisCommand(n->ctx, "CLUSTER SLOTS"));
            if (r == nullptr) {
                fail(*n);
                continue;
            }
            ok(*n);
            bool good = r->type == REDIS_REPLY_ARRAY;
            if (good) {
                slots_.fill(nullptr);
                for (std::size_t i = 0; i < r->elements; ++i) {
                    const redisReply* e = r->element[i];
                    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[2]->type != REDIS_REPLY_ARRAY ||
                        e->element[2]->elements < 2)
                        continue;
                    const redisReply* m = e->element[2];
                    node* owner = node_of(std::string(m->element[0]->str, m->element[0]->len),
                                          static_cast<int>(m->element[1]->integer));
                    for (long long s = e->element[0]->integer; s <= e->element[1]->integer && s < 16384; ++s)
                        if (s >= 0) slots_[static_cast<std::size_t>(s)] = owner;
                }
            }
            freeReplyObject(r);
            if (good) return;
        }
    }

    /// Parses "MOVED <slot> <host>:<port>" / "ASK ..." into the node it names.
    node* redirect_target(const redisReply* r, bool& ask) {
        const std::string_view e(r->str, r->len);
        ask = e.starts_with("ASK ");
        if (!ask && !e.starts_with("MOVED ")) return nullptr;
        const std::size_t sp = e.find(' ', ask ? 4 : 6);
        const std::size_t colon = e.rfind(':');
        if (sp == std::string_view::npos || colon == std::string_view::npos || colon < sp) return nullptr;
        std::string host(e.substr(sp + 1, colon - sp - 1));
        const int port = std::atoi(std::string(e.substr(colon + 1)).c_str());
        if (port <= 0) return nullptr;
        const auto slot = static_cast<std::size_t>(std::atoi(std::string(e.substr(ask ? 4 : 6, sp)).c_str()));
        node* t = node_of(host, port);
        if (!ask && slot < 16384) slots_[slot] = t;
        return t;
    }

    /// Runs one command for key rk on its node, following redirects; nullptr on failure.
    redisReply* command(const std::string& rk, std::initializer_list<std::string_view> args) {
        return command_at(route(rk), rk, args, false, opt_.max_redirects);
    }
    redisReply* command_at(node* n, const std::string& rk, std::initializer_list<std::string_view> args, bool asking,
                           int redirects_left, std::span<const std::byte> value = {}) {
        if (n == nullptr || !usable(*n)) return nullptr;
        send_queue(*n);  // keep the order: queued writes first
        if (n->ctx == nullptr) return nullptr;
        std::vector<const char*> argv;
        std::vector<std::size_t> len;
        for (std::string_view a : args) {
            argv.push_back(a.data());
            len.push_back(a.size());
        }
        if (!value.empty()) {  // SET key <value> [PX ttl]
            argv.insert(argv.begin() + 2, reinterpret_cast<const char*>(value.data()));
            len.insert(len.begin() + 2, value.size());
        }
        if (asking) redisAppendCommand(n->ctx, "ASKING");
        redisAppendCommandArgv(n->ctx, static_cast<int>(argv.size()), argv.data(), len.data());
        void* raw = nullptr;
        if (asking) {
            if (redisGetReply(n->ctx, &raw) != REDIS_OK) {
                fail(*n);
                return nullptr;
            }
            freeReplyObject(raw);
        }
        if (redisGetReply(n->ctx, &raw) != REDIS_OK) {
            fail(*n);
            return nullptr;
        }
        ok(*n);
        auto* r = static_cast<redisReply*>(raw);
        if (r->type == REDIS_REPLY_ERROR && opt_.cluster && redirects_left > 0) {
            bool ask = false;
            if (node* t = redirect_target(r, ask)) {
                freeReplyObject(r);
                ++(ask ? stats_.ask : stats_.moved);
                if (!ask) slots_loaded_ = false;  // the map changed: reread it on the next route
                return command_at(t, rk, args, ask, redirects_left - 1, value);
            }
        }
        return r;
    }

    /// Sends n's queued SETs as one pipeline and reads every reply.
    void send_queue(node& n) {
        if (n.queue.empty() || n.ctx == nullptr) return;
        std::vector<pending> q;
        q.swap(n.queue);
        const std::string ttl = std::to_string(opt_.ttl_ms);
        for (const pending& p : q) {
            const char* argv[5] = {"SET", p.key.data(), reinterpret_cast<const char*>(p.blob.data()), "PX", ttl.c_str()};
            const std::size_t len[5] = {3, p.key.size(), p.blob.size(), 2, ttl.size()};
            redisAppendCommandArgv(n.ctx, opt_.ttl_ms > 0 ? 5 : 3, argv, len);
            // Written at once, so the output buffer never holds more than one value.
            for (int done = 0; done == 0;)
                if (redisBufferWrite(n.ctx, &done) != REDIS_OK) {
                    stats_.put_failures += q.size();
                    fail(n);
                    return;
                }
        }
        for (std::size_t i = 0; i < q.size(); ++i) {
            void* raw = nullptr;
            if (redisGetReply(n.ctx, &raw) != REDIS_OK) {
                stats_.put_failures += q.size() - i;
                fail(n);
                return;
            }
            auto* r = static_cast<redisReply*>(raw);
            if (r->type == REDIS_REPLY_ERROR) {
                bool ask = false;
                node* t = opt_.cluster ? redirect_target(r, ask) : nullptr;
                freeReplyObject(r);
                if (t == nullptr) {
                    ++stats_.put_failures;
                    continue;
                }
                ++(ask ? stats_.ask : stats_.moved);
                if (!ask) slots_loaded_ = false;
                // Redirected write: sent on its own to the node named (not the pipeline).
                const std::string_view px = opt_.ttl_ms > 0 ? std::string_view("PX") : std::string_view();
                redisReply* rr = opt_.ttl_ms > 0
                                     ? command_at(t, q[i].key, {"SET", q[i].key, px, ttl}, ask, opt_.max_redirects - 1, q[i].blob)
                                     : command_at(t, q[i].key, {"SET", q[i].key}, ask, opt_.max_redirects - 1, q[i].blob);
                const bool good = rr != nullptr && rr->type == REDIS_REPLY_STATUS;
                if (rr != nullptr) freeReplyObject(rr);
                if (good)
                    bytes_written_ += q[i].blob.size();
                else
                    ++stats_.put_failures;
                if (n.ctx == nullptr) {  // n failed meanwhile? (t may be n)
                    stats_.put_failures += q.size() - i - 1;
                    return;
                }
                continue;
            }
            if (r->type == REDIS_REPLY_STATUS) bytes_written_ += q[i].blob.size();
            else ++stats_.put_failures;
            freeReplyObject(r);
        }
        ok(n);
    }

    redis_tier_options opt_;
    std::map<std::string, std::unique_ptr<node>> nodes_;  // by "host:port"
    std::array<node*, 16384> slots_{};                    // cluster: slot -> owner (nullptr: unknown)
    bool slots_loaded_ = false;
    redis_tier_stats stats_;
    std::size_t bytes_written_ = 0;
};

}  // namespace tier
KVCACHE_END_NAMESPACE

#else
#define KVCACHE_HAS_REDIS_TIER 0
#endif
