// The translation unit that owns the server libraries' precompiled header (server/CMakeLists.txt):
// compiled with their flags, so that their compilations can reuse the header.
