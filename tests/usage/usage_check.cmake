# ctest driver of the usage_* tests: runs `BINARY [SUBCOMMAND] --help` and `... --version`.
# -DBINARY=<path> -DPROGRAM=<name it calls itself> [-DSUBCOMMAND=<sub>] -DVERSION=<project version>
# -DEXPECT=<text>|<text>...: what --help must print, each somewhere on stdout.
string(REPLACE "|" ";" expect "${EXPECT}")
set(label "${PROGRAM}")
if(SUBCOMMAND)
  string(APPEND label " ${SUBCOMMAND}")
endif()

execute_process(COMMAND ${BINARY} ${SUBCOMMAND} --help RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err TIMEOUT 20)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${label} --help exited with ${rc}\nstdout:\n${out}\nstderr:\n${err}")
endif()
foreach(text IN LISTS expect)
  string(FIND "${out}" "${text}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${label} --help does not print \"${text}\":\n${out}")
  endif()
endforeach()

execute_process(COMMAND ${BINARY} ${SUBCOMMAND} --version RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err TIMEOUT 20)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${label} --version exited with ${rc}\nstdout:\n${out}\nstderr:\n${err}")
endif()
string(REPLACE "." "\\." version_re "${VERSION}")
if(NOT out MATCHES "^${PROGRAM} ${version_re} \\(git [^ ,]+, api [0-9]+\\.[0-9]+\\)\n$")
  message(FATAL_ERROR
          "${label} --version printed \"${out}\", not \"${PROGRAM} ${VERSION} (git <rev>, api <x.y>)\"")
endif()
message("${label}: --help and --version ok: ${out}")
