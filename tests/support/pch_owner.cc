// The translation unit that owns the tests' precompiled header (tests/CMakeLists.txt): it is
// compiled with the test binaries' flags so that their compilations can reuse the header. With
// gtest_main linked in it is a test binary without tests; ctest does not run it.
