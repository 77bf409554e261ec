from fastgrpo.cli import main

main()
