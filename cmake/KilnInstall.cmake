# Installs libkiln (shared and static), the public headers, the kiln CLI, kiln.pc and a
# CMake package (kilnConfig.cmake, version file, targets kiln::kiln and kiln::kiln_static)
# so that another project can `find_package(kiln)` or `pkg-config --libs kiln`. Both are
# relocatable: `cmake --install build --prefix DIR` works for any DIR.
include(CMakePackageConfigHelpers)

set(KILN_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kiln")

install(TARGETS kiln kiln_static EXPORT kilnTargets
  LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
  ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
  RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}"
  INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/include/"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
  FILES_MATCHING PATTERN "*.h")
if(TARGET kiln_cli)
  install(TARGETS kiln_cli RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
endif()

install(EXPORT kilnTargets NAMESPACE kiln:: DESTINATION "${KILN_INSTALL_CMAKEDIR}")
configure_package_config_file(cmake/kilnConfig.cmake.in
  "${CMAKE_CURRENT_BINARY_DIR}/kilnConfig.cmake"
  INSTALL_DESTINATION "${KILN_INSTALL_CMAKEDIR}")
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/kilnConfigVersion.cmake"
  VERSION ${PROJECT_VERSION}
  # 0.x: a minor bump may break the API, so only the same minor is compatible.
  COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/kilnConfig.cmake"
              "${CMAKE_CURRENT_BINARY_DIR}/kilnConfigVersion.cmake"
  DESTINATION "${KILN_INSTALL_CMAKEDIR}")

# kiln.pc: ${pcfiledir} makes it relocatable (pkg-config and pkgconf both define it).
file(RELATIVE_PATH KILN_PC_PREFIX_FROM_PCDIR
     "/kiln-root/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/kiln-root")
string(REGEX REPLACE "/$" "" KILN_PC_PREFIX_FROM_PCDIR "${KILN_PC_PREFIX_FROM_PCDIR}")
configure_file(cmake/kiln.pc.in "${CMAKE_CURRENT_BINARY_DIR}/kiln.pc" @ONLY)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/kiln.pc"
  DESTINATION "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
