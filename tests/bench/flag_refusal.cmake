# ctest driver of the arfuse_bench_*_refuses tests: runs `arfuse-bench` with ARGS (a
# semicolon-separated list) and passes when it exits 2 with EXPECT in its stderr and nothing on
# stdout (a refused command line runs nothing).
# -DBENCH=<arfuse-bench> -DARGS=<subcommand;--flag=value;...> -DEXPECT=<part of the message>
execute_process(
  COMMAND ${BENCH} ${ARGS}
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  TIMEOUT 20)
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "arfuse-bench ${ARGS} exited with ${rc}, not 2:\n${err}")
endif()
string(FIND "${err}" "${EXPECT}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "arfuse-bench ${ARGS}: stderr lacks '${EXPECT}':\n${err}")
endif()
if(NOT out STREQUAL "")
  message(FATAL_ERROR "arfuse-bench ${ARGS} printed on stdout:\n${out}")
endif()
