# What `cmake --install` puts under its prefix, and how a downstream project finds it:
#   bin/arfused, bin/arfusectl                      (arfusectl also in a client-only build)
#   lib/libarfuse_client.a, lib/libarfuse_proto.a   the C++ client (arfuse::client)
#   lib/libarfuse_ring.so.<soversion>              the ring library (CUDA builds; arfuse::ring)
#   include/arfuse/...                               headers, by their path in this repository
#   lib/cmake/arfuse/                                find_package(arfuse) (arfuseConfig.cmake)
#   lib/pkgconfig/arfuse.pc (+ arfuse-ring.pc)       pkg-config
#   share/doc/arfuse/LICENSE
#
# A library joins with arfuse_install_library(<target> [HEADERS <repo-relative paths>...]
# [PKGCONFIG <name> DESCRIPTION <text>]) after its add_library(): the rule sets the SONAME of a
# shared library (VERSION/SOVERSION from the VERSION file), exports it as arfuse::<name without
# the arfuse_ prefix>, installs its headers under include/arfuse/<their repository path> and, with
# PKGCONFIG, writes a .pc file for it. Its include directories must name the install tree as
# $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/arfuse> beside their $<BUILD_INTERFACE:...>.
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The ABI of the shared libraries changes with the major version (a 0.x release may change it
# with any minor: 0.x libraries are libfoo.so.0.<minor>).
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(ARFUSE_SOVERSION "0.${PROJECT_VERSION_MINOR}")
else()
  set(ARFUSE_SOVERSION "${PROJECT_VERSION_MAJOR}")
endif()
# Installed binaries keep the run paths of libraries outside the system's (the CUDA toolkit's
# libcudart), so arfused runs from the prefix as it does from the build tree.
set(CMAKE_INSTALL_RPATH_USE_LINK_PATH ON)
set(ARFUSE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/arfuse)
set(ARFUSE_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/arfuse)

# The .pc files name their prefix relative to their own directory, so `cmake --install
# --prefix P` (decided at install time, not at configure time) and a moved tree stay right.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(ARFUSE_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(ARFUSE_PC_LIBDIR "${CMAKE_INSTALL_LIBDIR}")
else()
  string(REGEX REPLACE "[^/]+" ".." _arfuse_up "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
  set(ARFUSE_PC_PREFIX "\${pcfiledir}/${_arfuse_up}")
  set(ARFUSE_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
endif()

function(arfuse_install_library target)
  cmake_parse_arguments(L "" "PKGCONFIG;DESCRIPTION;REQUIRES" "HEADERS;LIBS" ${ARGN})
  string(REGEX REPLACE "^arfuse_" "" export_name ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${export_name})
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "SHARED_LIBRARY")
    set_target_properties(${target} PROPERTIES VERSION ${PROJECT_VERSION}
                                               SOVERSION ${ARFUSE_SOVERSION})
  endif()
  install(TARGETS ${target} EXPORT arfuseTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} NAMELINK_COMPONENT Development
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  foreach(header ${L_HEADERS})
    get_filename_component(dir ${header} DIRECTORY)
    if(IS_ABSOLUTE ${header})
      message(FATAL_ERROR "arfuse_install_library(${target}): HEADERS are repository paths")
    endif()
    install(FILES ${CMAKE_SOURCE_DIR}/${header} DESTINATION ${ARFUSE_INSTALL_INCLUDEDIR}/${dir})
  endforeach()
  if(L_PKGCONFIG)
    set(PC_NAME ${L_PKGCONFIG})
    set(PC_DESCRIPTION ${L_DESCRIPTION})
    set(PC_REQUIRES ${L_REQUIRES})
    list(TRANSFORM L_LIBS PREPEND "-l")
    list(JOIN L_LIBS " " PC_LIBS)
    configure_file(${PROJECT_SOURCE_DIR}/cmake/arfuse.pc.in
                   ${PROJECT_BINARY_DIR}/pkgconfig/${L_PKGCONFIG}.pc @ONLY)
    install(FILES ${PROJECT_BINARY_DIR}/pkgconfig/${L_PKGCONFIG}.pc
            DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
  endif()
endfunction()

# The package files; called once at the end of the top-level CMakeLists.txt, after every
# arfuse_install_library().
function(arfuse_install_package)
  install(EXPORT arfuseTargets NAMESPACE arfuse:: DESTINATION ${ARFUSE_INSTALL_CMAKEDIR})
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/arfuseConfig.cmake.in
                                ${PROJECT_BINARY_DIR}/arfuseConfig.cmake
                                INSTALL_DESTINATION ${ARFUSE_INSTALL_CMAKEDIR})
  # 0.x: a new minor may break the API; from 1.0 on, the same major is compatible.
  if(PROJECT_VERSION_MAJOR EQUAL 0)
    set(compat SameMinorVersion)
  else()
    set(compat SameMajorVersion)
  endif()
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/arfuseConfigVersion.cmake
                                   COMPATIBILITY ${compat})
  install(FILES ${PROJECT_BINARY_DIR}/arfuseConfig.cmake
                ${PROJECT_BINARY_DIR}/arfuseConfigVersion.cmake
          DESTINATION ${ARFUSE_INSTALL_CMAKEDIR})
  install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})
endfunction()
