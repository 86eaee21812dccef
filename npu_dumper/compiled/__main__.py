from npu_dumper.compiled.cli import main

main()
