// Test helper: doctest prints a kvcache::result<T> as "ok" or "<code>: <message>", so
// REQUIRE(cache.seq_rm(...)) shows why a call was refused, and refused_with() checks a
// refusal's code and message.
#pragma once

#include <doctest/doctest.h>
#include <kvcache/error.hpp>

#include <string>
#include <type_traits>

namespace doctest {
template <class T>
struct StringMaker<kvcache::result<T>> {
    static String convert(const kvcache::result<T>& r) {
        if (r.ok()) return "ok";
        return (std::string(kvcache::to_string(r.code())) + ": " + r.message()).c_str();
    }
};
}  // namespace doctest

namespace kvtest {

/// How a call refused: it threw kvcache::error (a programming error) or returned an error
/// result (an expected runtime condition), or it did not refuse.
enum class refusal_kind { none, thrown, returned };

struct refusal {
    refusal_kind kind = refusal_kind::none;
    kvcache::errc code = kvcache::errc::ok;
    std::string message;  // what() of an exception; "<code>: <message>" of a result
};

/// Runs f (void, or returning a kvcache::result) and reports how it refused.
template <class F>
refusal run_refusal(F&& f) {
    try {
        if constexpr (std::is_void_v<decltype(f())>) {
            f();
            return {};
        } else {
            auto r = f();
            if (r.ok()) return {};
            return {refusal_kind::returned, r.code(), std::string(kvcache::to_string(r.code())) + ": " + r.message()};
        }
    } catch (const kvcache::error& e) {
        return {refusal_kind::thrown, e.code(), e.what()};
    }
}

/// The error rule (README): invalid arguments, calls in the wrong state and bad
/// configurations throw; no room (no_space) is an error result. unsupported is a result
/// for a refusal by the layout's history (ring: pruned positions) and thrown for an
/// operation the layout can never do (can_shift == false): callers pass the kind.
inline refusal_kind rule_kind(kvcache::errc code) {
    switch (code) {
        case kvcache::errc::invalid_argument:
        case kvcache::errc::invalid_config:
        case kvcache::errc::transaction_open: return refusal_kind::thrown;
        default: return refusal_kind::returned;
    }
}

/// Whether r is an error whose "<code>: <message>" contains `needle` (the code's name or
/// part of the message).
template <class T>
bool refused_result(const kvcache::result<T>& r, const std::string& needle) {
    if (r.ok()) return false;
    return (std::string(kvcache::to_string(r.code())) + ": " + r.message()).find(needle) != std::string::npos;
}

/// Whether r is an error with this code whose message contains `needle`.
template <class T>
bool refused_with(const kvcache::result<T>& r, kvcache::errc code, const std::string& needle = {}) {
    return !r.ok() && r.code() == code && r.message().find(needle) != std::string::npos;
}
}  // namespace kvtest
