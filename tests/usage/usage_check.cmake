# ctest driver of the usage_* tests: runs `BINARY [SUBCOMMAND] --help` and `... --version`.
# -DBINARY=<path> -DPROGRAM=<name it calls itself> [-DSUBCOMMAND=<sub>] -DVERSION=<project version>
# -DEXPECT=<text>|<text>...: what --help must print, each somewhere on stdout.
string(REPLACE "|" ";" expect "${EXPECT}")
set(label "${PROGRAM}")
if(SUBCOMMAND)
  string(APPEND label " ${SUBCOMMAND}")
endif()

# Runs the binary with FLAG; fails the test unless it exits 0; its stdout goes to OUT_VAR.
function(run_flag flag out_var)
  execute_process(COMMAND ${BINARY} ${SUBCOMMAND} ${flag} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 20)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${label} ${flag} exited with ${rc}\nstdout:\n${out}\nstderr:\n${err}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

run_flag(--help help)
foreach(text IN LISTS expect)
  string(FIND "${help}" "${text}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${label} --help does not print \"${text}\":\n${help}")
  endif()
endforeach()

run_flag(--version version)
string(REPLACE "." "\\." version_re "${VERSION}")
if(NOT version MATCHES "^${PROGRAM} ${version_re} \\(git [^ ,]+, api [0-9]+\\.[0-9]+\\)\n$")
  message(FATAL_ERROR
          "${label} --version printed \"${version}\", not \"${PROGRAM} ${VERSION} (git <rev>, api <x.y>)\"")
endif()
message("${label}: --help and --version ok: ${version}")
