// The translation unit that builds the tests' precompiled header (tests/support/test_pch.hpp).
